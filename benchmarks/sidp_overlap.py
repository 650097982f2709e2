"""SiDP CaS with and without overlap (``casOverlap``): the exchange of one micro-batch in flight
while the other's attention runs (SiDP §4.3), against one exchange per layer after all attention.

    .venv/bin/python benchmarks/sidp_overlap.py          # → benchmarks/sidp_overlap.json
    .venv/bin/python benchmarks/sidp_overlap.py --quick  # a smaller model, 3 repetitions
    .venv/bin/python benchmarks/sidp_overlap.py --dp 3   # → benchmarks/sidp_overlap_dp3.json

dp replicas (one process each, one torch thread), fp32, a random Llama-shaped model, CaS pinned:
the regime CaS is for, the small-batch tail (a few sequences per replica). Both groups run at
once, idle while the other measures; each repetition runs every (batch, overlap) pair, the order
rotated between repetitions. Reported per pair: decode tokens/s and ms per engine step, mean and
spread (min, max) over repetitions, the on/off ratio of each repetition, and the overlap counters
(messages still posted while the other half's attention ran; of those, not yet complete when it
began). The host's load average is recorded before and after: the machine is shared.
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
from gearshift.worker.launch.replicas import ReplicaGroup, start_replicas
from gearshift.worker.policies.registry import make_policy
from gearshift.worker.sampling.params import SamplingParams

HERE = Path(__file__).resolve().parent
VOCAB = 1024
BLOCK = 16


def _start(folder: Path, dp: int, overlap: bool, seqs: int) -> ReplicaGroup:
    config = EngineConfig(
        model=str(folder),
        dtype="float32",
        kv_cache_bytes=64 << 20,
        skip_tokenizer_init=True,
        block_size=BLOCK,
        max_num_seqs=max(64, seqs),
        max_num_batched_tokens=2048,
        num_threads=1,
    )
    policy = make_policy({"sidp": {"dp": dp, "mode": "CAS", "casOverlap": overlap}})
    return start_replicas(config, policy, GroupConfig(timeout_s=600))


def _run(group: ReplicaGroup, dp: int, seqs: int, prompt: int, output: int, tag: str) -> dict:
    g = torch.Generator().manual_seed(11)
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    work = {
        r: [
            (f"{tag}-{r}-{i}", torch.randint(0, VOCAB, (prompt,), generator=g).tolist(), params)
            for i in range(seqs)
        ]
        for r in range(dp)
    }
    before = [group.stats(r) for r in range(dp)]
    start = time.perf_counter()
    results = group.generate(work)
    wall = time.perf_counter() - start
    after = [group.stats(r) for r in range(dp)]
    if any(reason != "length" for _, reason in results.values()):
        raise RuntimeError(f"{tag}: a request did not run to its length")
    steps = max(a["engine"].steps - b["engine"].steps for a, b in zip(after, before, strict=True))

    def counter(key: str) -> float:
        return sum(a["policy"][key] - b["policy"][key] for a, b in zip(after, before, strict=True))

    return {
        "wall_s": wall,
        "tokens_per_s": dp * seqs * output / wall,
        "ms_per_step": wall / steps * 1e3,
        "steps": steps,
        "overlapped": counter("sidp_cas_overlapped"),
        "overlapped_moving": counter("sidp_cas_overlapped_moving"),
    }


def _spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.mean(values), "min": min(values), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a smaller model, 3 repetitions")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--output", type=int, default=48)
    ap.add_argument("--batches", default="2,4,16", help="sequences per replica, comma-separated")
    args = ap.parse_args()
    if args.quick:
        args.hidden, args.layers, args.output, args.repeats = 256, 4, 24, 3
    if args.repeats < 3:
        ap.error("--repeats must be at least 3 (mean and spread)")
    batches = [int(b) for b in args.batches.split(",")]
    sys.path.insert(0, str(HERE.parent))  # the random checkpoints of the tests
    from tests.worker.helpers import make_hf_checkpoint

    tmp = tempfile.TemporaryDirectory()
    folder = make_hf_checkpoint(
        Path(tmp.name), "llama2-bias", hidden=args.hidden, layers=args.layers, vocab=VOCAB
    )
    report: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "host_note": "2 shared CPU cores, other engineers' jobs running: absolute figures are "
        "load-dependent; compare the on/off ratios within this run",
        "load_avg_before": os.getloadavg(),
        "dp": args.dp,
        "hidden": args.hidden,
        "layers": args.layers,
        "prompt": args.prompt,
        "output": args.output,
    }
    groups: dict[bool, ReplicaGroup] = {}
    pairs = [(b, on) for b in batches for on in (True, False)]
    runs: dict[str, list[dict]] = {f"b{b}_{'on' if on else 'off'}": [] for b, on in pairs}
    try:
        for on in (True, False):
            groups[on] = _start(folder, args.dp, on, max(batches))
        for on in (True, False):  # warm-up, untimed
            _run(groups[on], args.dp, 2, args.prompt, 4, f"warm{int(on)}")
        for rep in range(args.repeats):
            k = rep % len(pairs)
            for b, on in pairs[k:] + pairs[:k]:  # rotate the order
                key = f"b{b}_{'on' if on else 'off'}"
                runs[key].append(_run(groups[on], args.dp, b, args.prompt, args.output, key))
                print(key, rep, json.dumps(runs[key][-1]), flush=True)
    finally:
        for group in groups.values():
            group.shutdown()
    report["load_avg_after"] = os.getloadavg()
    report["runs"] = runs
    summary: dict[str, Any] = {}
    for b in batches:
        on, off = runs[f"b{b}_on"], runs[f"b{b}_off"]
        ratios = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(on, off, strict=True)]
        summary[f"b{b}"] = {
            "tokens_per_s_on": _spread([r["tokens_per_s"] for r in on]),
            "tokens_per_s_off": _spread([r["tokens_per_s"] for r in off]),
            "ms_per_step_on": _spread([r["ms_per_step"] for r in on]),
            "ms_per_step_off": _spread([r["ms_per_step"] for r in off]),
            "on_over_off_tokens_per_s": _spread(ratios),
            "overlapped_per_run": statistics.mean(r["overlapped"] for r in on),
            "overlapped_moving_per_run": statistics.mean(r["overlapped_moving"] for r in on),
        }
    report["summary"] = summary
    never_slower = all(s["on_over_off_tokens_per_s"]["min"] >= 1.0 for s in summary.values())
    report["overlap_never_slower_here"] = never_slower
    report["statement"] = "; ".join(
        f"{b} seqs/replica: overlap on/off tokens/s {s['on_over_off_tokens_per_s']['mean']:.3f}x "
        f"(min {s['on_over_off_tokens_per_s']['min']:.3f}, max "
        f"{s['on_over_off_tokens_per_s']['max']:.3f})"
        for b, s in ((k[1:], v) for k, v in summary.items())
    )
    print(json.dumps(summary, indent=2))
    print(report["statement"])
    name = (
        "sidp_overlap"
        + (f"_dp{args.dp}" if args.dp != 2 else "")
        + ("_quick" if args.quick else "")
    )
    out = HERE / f"{name}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
