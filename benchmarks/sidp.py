"""SiDP on this host: KV capacity, per-step decode time by mode, and an offline heavy-tailed job.

    .venv/bin/python benchmarks/sidp.py            # → benchmarks/sidp.{json,png}

All in one run, dp = 2 replicas (one process each), fp32, a random Llama-shaped model:
(a) KV capacity in tokens, SiDP vs plain DP at the same memory budget (formula, and the block
    counts the started replicas really allocated);
(b) time per decode step vs batch size per replica for WaS, CaS and plain DP (two independent
    full-weight engines), and the crossover (paper Fig. 11: CaS wins at B ≤ 32 on H100s);
(c) an offline job with heavy-tailed output lengths: total time for SiDP AUTO (the router's
    controller fed by the replicas' batch sizes), WaS only, CaS only and plain DP (Fig. 13).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as pymp
import queue
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from gearshift.operator.router.sidp_controller import (
    CAS,
    ControllerParameters,
    ModeController,
    thresholds_from_profile,
)
from gearshift.worker.config import EngineConfig
from gearshift.worker.engine.loading import inspect_model
from gearshift.worker.kv.cache import KVCacheSpec
from gearshift.worker.launch import start_engine
from gearshift.worker.launch.replicas import Results, start_replicas
from gearshift.worker.policies.registry import make_policy
from gearshift.worker.policies.sidp.ffn import Mode
from gearshift.worker.policies.sidp.group_step import request_mode
from gearshift.worker.policies.sidp.ownership import Ownership, weight_bytes
from gearshift.worker.sampling.params import SamplingParams

HERE = Path(__file__).resolve().parent
DP = 2


def _engine_config(folder: Path, kv_bytes: int) -> EngineConfig:
    return EngineConfig(
        model=str(folder),
        dtype="float32",
        kv_cache_bytes=kv_bytes,
        skip_tokenizer_init=True,
        max_model_len=256,
        max_num_batched_tokens=512,
        num_threads=1,
    )


def _prompts(n: int, seed: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (8,), generator=g).tolist() for _ in range(n)]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _plain_replica(config: EngineConfig, jobs: list[tuple[list[int], int]], barrier, out) -> None:
    engine = start_engine(config)
    engine.generate([p for p, _ in jobs], [_greedy(2) for _ in jobs])  # warm-up, not timed
    barrier.wait()
    start = time.perf_counter()
    engine.generate([p for p, _ in jobs], [_greedy(n) for _, n in jobs])
    out.put((time.perf_counter() - start, engine.stats().steps))
    engine.shutdown()


def plain_dp(config: EngineConfig, jobs: list[list[tuple[list[int], int]]]) -> tuple[float, int]:
    """Two independent full-weight engines, one process each, started together."""
    ctx = pymp.get_context("spawn")
    barrier, out = ctx.Barrier(len(jobs)), ctx.Queue()
    procs = [ctx.Process(target=_plain_replica, args=(config, j, barrier, out)) for j in jobs]
    for p in procs:
        p.start()
    got: list[tuple[float, int]] = []
    deadline = time.monotonic() + 600
    while len(got) < len(procs):
        try:
            got.append(out.get(timeout=1))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"plain DP replica failed (exit codes {dead})") from None
    for p in procs:
        p.join(60)
    return max(t for t, _ in got), max(s for _, s in got)


def sidp_run(group: Any, jobs: list[list[tuple[list[int], int]]], controller=None) -> float:
    work = {
        r: [(f"r{r}-{i}-{time.monotonic_ns()}", p, _greedy(n)) for i, (p, n) in enumerate(js)]
        for r, js in enumerate(jobs)
    }
    start = time.perf_counter()
    pending = group.submit(work)
    results: Results = {}
    while any(pending.values()):
        group.poll(pending, results, wait_s=0.002)
        if controller is not None:
            batches = [group.stats(r)["engine"].num_running for r in range(group.replicas)]
            controller.observe(batches)
    return time.perf_counter() - start


def kv_capacity(folder: Path, kv_bytes: int, group_blocks: int) -> dict[str, Any]:
    spec, source = inspect_model(_engine_config(folder, kv_bytes), torch.device("cpu"))
    source.close()
    cfg = spec.config
    block = _engine_config(folder, kv_bytes).block_size
    kv = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block, torch.float32)
    wb = weight_bytes(cfg, Ownership(DP, cfg.num_layers), 0, DP - 1, 4)
    full = wb.replicated + cfg.num_layers * wb.ffn_layer
    plain_tokens = kv.blocks_for_bytes(kv_bytes) * block
    sidp_tokens = kv.blocks_for_bytes(kv_bytes + wb.freed(cfg.num_layers)) * block
    return {
        "budget_bytes_per_rank": full + kv_bytes,
        "plain_dp_weights": full,
        "sidp_weights_resident": wb.resident,
        "plain_dp_kv_tokens": plain_tokens,
        "sidp_kv_tokens": sidp_tokens,
        "sidp_kv_tokens_measured": group_blocks * block,
        "ratio": sidp_tokens / plain_tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batches", default="1,4,16,32")
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--offline-requests", type=int, default=24)
    args = ap.parse_args()
    sys.path.insert(0, str(HERE.parent))  # the random checkpoints of the tests
    from tests.worker.helpers import make_hf_checkpoint

    vocab = 1024
    tmp = tempfile.TemporaryDirectory()
    folder = make_hf_checkpoint(
        Path(tmp.name), "llama2-bias", hidden=args.hidden, layers=args.layers, vocab=vocab
    )
    # The paper's regime: weights dominate a rank's memory. Plain DP's KV gets a quarter of
    # its weight bytes; SiDP gets the same total budget.
    spec, source = inspect_model(_engine_config(folder, 1 << 20), torch.device("cpu"))
    source.close()
    full = weight_bytes(spec.config, Ownership(1, spec.config.num_layers), 0, 0, 4).resident
    kv_bytes = max(2 << 20, full // 4)
    config = _engine_config(folder, kv_bytes)
    batches = [int(b) for b in args.batches.split(",")]
    steps = args.decode_tokens
    report: dict[str, Any] = {"dp": DP, "hidden": args.hidden, "layers": args.layers}

    decode: dict[str, dict[int, float]] = {"WAS": {}, "CAS": {}, "plain": {}}
    for b in batches:
        jobs = [[(p, steps) for p in _prompts(b, 10 + r, vocab)] for r in range(DP)]
        t, _ = plain_dp(config, jobs)
        decode["plain"][b] = t / steps * 1e3
    offline_jobs = []
    g = torch.Generator().manual_seed(7)
    for r in range(DP):
        lengths = (4 / torch.rand(args.offline_requests, generator=g) ** 0.8).clamp(max=160)
        prompts = _prompts(args.offline_requests, 100 + r, vocab)
        offline_jobs.append(list(zip(prompts, lengths.int().tolist(), strict=True)))
    offline: dict[str, float] = {"plain": plain_dp(config, offline_jobs)[0]}
    # Every timed run follows an untimed short one on the same engines (plain DP's too).
    for mode in ("WAS", "CAS"):
        group = start_replicas(config, make_policy({"sidp": {"dp": DP, "mode": mode}}))
        try:
            if mode == "WAS":
                report["kv_capacity"] = kv_capacity(folder, kv_bytes, group.ready[0]["num_blocks"])
            for b in batches:
                jobs = [[(p, steps) for p in _prompts(b, 10 + r, vocab)] for r in range(DP)]
                sidp_run(group, [[(p, 2) for p, _ in js] for js in jobs])  # warm-up
                decode[mode][b] = sidp_run(group, jobs) / steps * 1e3
            sidp_run(group, [[(p, 2) for p, _ in js] for js in offline_jobs])  # warm-up
            offline[mode] = sidp_run(group, offline_jobs)
        finally:
            group.shutdown()
    group = start_replicas(config, make_policy({"sidp": {"dp": DP, "mode": "AUTO"}}))
    try:
        sidp_run(group, [[(p, 2) for p, _ in js] for js in offline_jobs])  # warm-up
        params = ControllerParameters(
            cas_enter_batch_size=8, was_enter_batch_size=16, window_steps=4, min_dwell_steps=8
        )
        store = group.store
        ctl = ModeController(params, lambda m: request_mode(store, Mode(m)))
        offline["AUTO"] = sidp_run(group, offline_jobs, ctl)
        report["auto_switches"] = ctl.switches
        report["auto_ended_in_cas"] = ctl.mode == CAS
    finally:
        group.shutdown()

    crossover = [b for b in batches if decode["CAS"][b] < decode["WAS"][b]]
    report["decode_ms_per_step"] = decode
    report["cas_faster_than_was_at"] = crossover
    # What to put in the policy on this host (the issue's `sidp-profile`, as a benchmark).
    use = thresholds_from_profile(decode["WAS"], decode["CAS"])
    report["thresholds_to_use"] = (
        {"casEnterBatchSize": use[0], "wasEnterBatchSize": use[1]}
        if use
        else {"mode": "WAS", "why": "CaS was not faster at any batch size measured"}
    )
    report["offline_s"] = offline
    report["offline_lengths"] = [n for js in offline_jobs for _, n in js]
    print(json.dumps(report, indent=2))
    print("sidp thresholds to use on this host:", json.dumps(report["thresholds_to_use"]))
    (HERE / "sidp.json").write_text(json.dumps(report, indent=2) + "\n")
    _plot(report, batches)


def _plot(report: dict[str, Any], batches: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, series in report["decode_ms_per_step"].items():
        a.plot(batches, [series[x] for x in batches], marker="o", label=name)
    a.set_xscale("log", base=2)
    a.set_xlabel("batch per replica")
    a.set_ylabel("ms per decode step (wall / tokens)")
    a.set_title(f"dp {DP}: WaS vs CaS vs plain DP")
    a.legend()
    names = list(report["offline_s"])
    b.bar(names, [report["offline_s"][n] for n in names])
    b.set_ylabel("s")
    b.set_title("offline heavy-tailed job, total time")
    fig.tight_layout()
    fig.savefig(HERE / "sidp.png", dpi=100)


if __name__ == "__main__":
    main()
