"""SiDP (WaS, CaS, AUTO) vs plain DP at equal per-rank memory on a KV-bound workload.

    .venv/bin/python benchmarks/sidp.py            # → benchmarks/sidp.json, sidp_profile.json
    .venv/bin/python benchmarks/sidp.py --quick    # a smaller model and workload, 3 repetitions

dp = 2 replicas (one process each), fp32, a random Llama-shaped model. Plain DP is
``PlainDpPolicy``: the same FFN modules, kernels and fused decode op, every replica holding every
weight. Every configuration gets the same ``kv_cache_bytes``; SiDP adds the FFN bytes it does not
hold, so weights + KV per rank are equal (the paper's "same memory budget", §5.2).

Measured, all on the running groups:
- KV capacity of one replica, by admitting sequences until the first preemption
  (``launch/kv_probe.py``), for plain DP and SiDP;
- the KV-bound workload (per replica, more sequences of long context than plain DP's cache
  holds at once): tokens/s, time per output token per request (submit to finish over its
  tokens, queueing included), engine steps, preemptions; repeated, the configurations
  interleaved within each repetition; mean and spread (min, max) over repetitions;
- AUTO's thresholds as the group measured them at start-up (written to sidp_profile.json, which
  ``GEARSHIFT_SIDP_PROFILE`` takes).
The report ends with whether the regime exists here: SiDP's tokens/s above plain DP's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from gearshift.worker.config import EngineConfig
from gearshift.worker.launch.group_config import GroupConfig
from gearshift.worker.launch.kv_probe import measure_kv_capacity
from gearshift.worker.launch.replicas import ReplicaGroup, Results, start_replicas
from gearshift.worker.policies.registry import make_policy
from gearshift.worker.policies.sidp.plain_dp import PlainDpPolicy
from gearshift.worker.policies.sidp.thresholds import SOURCE_MEASURED, ModeProfile
from gearshift.worker.sampling.params import SamplingParams

HERE = Path(__file__).resolve().parent
DP = 2
VOCAB = 1024
BLOCK = 16


def _config(folder: Path, kv_bytes: int, max_len: int, seqs: int) -> EngineConfig:
    return EngineConfig(
        model=str(folder),
        dtype="float32",
        kv_cache_bytes=kv_bytes,
        skip_tokenizer_init=True,
        block_size=BLOCK,
        max_model_len=max_len,
        max_num_seqs=seqs,
        max_num_batched_tokens=max(2048, seqs * BLOCK),
        num_threads=1,
    )


def _start(config: EngineConfig, name: str) -> ReplicaGroup:
    if name == "plain":
        policy = PlainDpPolicy(make_policy({"sidp": {"dp": DP, "mode": "WAS"}}).to_proto(), DP)
    else:
        policy = make_policy({"sidp": {"dp": DP, "mode": name}})
    return start_replicas(config, policy, GroupConfig(timeout_s=600))


def run_workload(group: ReplicaGroup, jobs: list[list[tuple[list[int], int]]], tag: str) -> dict:
    """Every replica's jobs at once; tokens/s, per-request time per output token, steps."""
    before = [group.stats(r)["engine"] for r in range(DP)]
    submitted: dict[str, float] = {}
    lengths: dict[str, int] = {}
    work = {}
    for r, js in enumerate(jobs):
        work[r] = []
        for i, (prompt, n) in enumerate(js):
            rid = f"{tag}-{r}-{i}"
            lengths[rid] = n
            work[r].append(
                (rid, prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
            )
    start = time.perf_counter()
    for rid in lengths:
        submitted[rid] = start
    pending = group.submit(work)
    results: Results = {}
    finished: dict[str, float] = {}
    while any(pending.values()):
        group.poll(pending, results, wait_s=0.002)
        now = time.perf_counter()
        for rid in results:
            finished.setdefault(rid, now)
    wall = time.perf_counter() - start
    after = [group.stats(r)["engine"] for r in range(DP)]
    bad = [rid for rid, (_, reason) in results.items() if reason != "length"]
    if bad:
        raise RuntimeError(f"{tag}: {results[bad[0]][1]}")
    tokens = sum(lengths.values())
    tpot = [(finished[rid] - submitted[rid]) / lengths[rid] * 1e3 for rid in lengths]
    return {
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "tpot_ms_mean": statistics.mean(tpot),
        "steps": max(a.steps - b.steps for a, b in zip(after, before, strict=True)),
        "preemptions": sum(
            a.num_preemptions - b.num_preemptions for a, b in zip(after, before, strict=True)
        ),
    }


def _spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.mean(values), "min": min(values), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small model and workload, 3 repetitions")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=192, help="prompt tokens per sequence")
    ap.add_argument("--output", type=int, default=32, help="output tokens per sequence")
    ap.add_argument("--seqs", type=int, default=32, help="sequences per replica")
    ap.add_argument(
        "--note", default="", help="what else ran on the host (saved in the JSON as host_note)"
    )
    args = ap.parse_args()
    if args.quick:
        args.hidden, args.layers, args.prompt, args.output, args.seqs = 256, 4, 96, 16, 16
    if args.repeats < 3:
        ap.error("--repeats must be at least 3 (mean and spread)")
    sys.path.insert(0, str(HERE.parent))  # the random checkpoints of the tests
    from tests.worker.helpers import make_hf_checkpoint

    tmp = tempfile.TemporaryDirectory()
    folder = make_hf_checkpoint(
        Path(tmp.name), "llama2-bias", hidden=args.hidden, layers=args.layers, vocab=VOCAB
    )
    # KV-bound: SiDP's cache (kv_cache_bytes + the FFN bytes it frees) holds one replica's whole
    # workload at once, plain DP's (kv_cache_bytes alone) that much less. KV bytes per token:
    # layers x 2 (k, v) x 2 KV heads x head_dim (hidden / 8 heads) x 4 bytes.
    per_token = args.layers * 2 * 2 * (args.hidden // 8) * 4
    seq_tokens = args.prompt + args.output
    ffn_layer = (3 * args.hidden * 2 * args.hidden + 2 * 2 * args.hidden + args.hidden) * 4
    freed = (args.layers - args.layers // DP - (DP - 1)) * ffn_layer  # remote layers less slots
    kv_bytes = max(per_token * seq_tokens * args.seqs - freed, per_token * seq_tokens * 2)
    max_len = -(-seq_tokens // BLOCK) * BLOCK
    config = _config(folder, kv_bytes, max_len, max(256, args.seqs))
    g = torch.Generator().manual_seed(7)
    jobs = [
        [
            (torch.randint(0, VOCAB, (args.prompt,), generator=g).tolist(), args.output)
            for _ in range(args.seqs)
        ]
        for _ in range(DP)
    ]
    names = ["plain", "WAS", "CAS", "AUTO"]
    report: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "host_note": args.note,
        "load_average_after": list(os.getloadavg()),
        "dp": DP,
        "hidden": args.hidden,
        "layers": args.layers,
        "kv_cache_bytes": kv_bytes,
        "workload": {"seqs_per_replica": args.seqs, "prompt": args.prompt, "output": args.output},
    }
    groups = {}
    try:
        for name in names:
            groups[name] = _start(config, name)
        report["kv_capacity_tokens"] = {
            name: measure_kv_capacity(
                groups[name], DP - 1, BLOCK, VOCAB, config.max_num_seqs
            ).tokens
            for name in ("plain", "WAS")
        }
        report["kv_capacity_ratio"] = (
            report["kv_capacity_tokens"]["WAS"] / report["kv_capacity_tokens"]["plain"]
        )
        auto = groups["AUTO"].stats(0)["policy"]
        batches = sorted(
            int(k.rsplit("_b", 1)[1]) for k in auto if k.startswith("sidp_profile_was_ms_b")
        )
        profile = ModeProfile(
            {b: auto[f"sidp_profile_was_ms_b{b}"] for b in batches},
            {b: auto[f"sidp_profile_cas_ms_b{b}"] for b in batches},
            SOURCE_MEASURED,
        )
        report["auto_profile"] = {"why": profile.why(), "figures": profile.figures()}
        (HERE / "sidp_profile.json").write_text(profile.to_json() + "\n")
        runs: dict[str, list[dict]] = {n: [] for n in names}
        for name in names:  # warm-up, untimed: first-step costs are not the regime's
            run_workload(groups[name], [js[:2] for js in jobs], f"{name}-warm")
        for rep in range(args.repeats):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:  # rotate the order
                runs[name].append(run_workload(groups[name], jobs, f"{name}{rep}"))
                print(name, rep, json.dumps(runs[name][-1]), flush=True)
    finally:
        for group in groups.values():
            group.shutdown()
    report["runs"] = runs
    report["summary"] = {
        name: {
            key: _spread([r[key] for r in rs])
            for key in ("tokens_per_s", "tpot_ms_mean", "steps", "preemptions")
        }
        for name, rs in runs.items()
    }
    s = report["summary"]
    best = max(("WAS", "CAS", "AUTO"), key=lambda n: s[n]["tokens_per_s"]["mean"])
    wins = s[best]["tokens_per_s"]["min"] > s["plain"]["tokens_per_s"]["max"]
    report["regime_exists_here"] = wins
    sidp_tps, plain_tps = s[best]["tokens_per_s"]["mean"], s["plain"]["tokens_per_s"]["mean"]
    verdict = (
        "SiDP beats plain DP here (every repetition)."
        if wins
        else "SiDP does not beat plain DP in every repetition here; see steps and preemptions."
    )
    report["statement"] = (
        f"SiDP {best} {sidp_tps:.1f} tokens/s vs plain DP {plain_tps:.1f} "
        f"({sidp_tps / plain_tps:.2f}x); measured KV {report['kv_capacity_ratio']:.2f}x plain "
        f"DP's; preemptions per run: plain DP {s['plain']['preemptions']['mean']:.0f}, SiDP WaS "
        f"{s['WAS']['preemptions']['mean']:.0f}. {verdict}"
    )
    print(json.dumps(report["summary"], indent=2))
    print(report["statement"])
    out = HERE / ("sidp_quick.json" if args.quick else "sidp.json")
    out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
