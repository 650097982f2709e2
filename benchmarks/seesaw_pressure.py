"""Seesaw under host-store pressure (issue 29): a device KV cache and a host store both smaller
than the workload, against the static layouts of the same 2 ranks with the same device KV.

Reports, per layout and workload, the mean and spread over interleaved repetitions of tokens/s,
gear transitions, recomputed prefill tokens (prefilled less prompt tokens: the engine's own
counts), preempted tokens and the swap-stall seconds (the engine had nothing to run but swap-ins
outstanding). Run through ``benchmarks/seesaw.py --pressure`` (``--quick`` for a short check).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

# Per rank and token: layers x 2 KV heads x head_dim 64 x (k, v) x fp32 / 2 ranks.
KV_BYTES_PER_LAYER_TOKEN = 2 * 64 * 2 * 4


def pressure_layouts(host_bytes: int) -> dict[str, Any]:
    return {
        "TP 2": {"static": {"tp": 2}},
        "PP 2": {"static": {"pp": 2}},
        "Seesaw P2->T2": {
            "seesaw": {
                "prefill": {"tp": 1, "pp": 2},
                "decode": {"tp": 2, "pp": 1},
                "hostKvCapacityBytes": host_bytes,
            }
        },
    }


def pressure_pass(engine: Any, work: list[tuple[list[int], int]]) -> dict[str, float]:
    from gearshift.worker.sampling.params import SamplingParams

    before = engine.stats()
    for i, (p, out_len) in enumerate(work):
        params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
        engine.add_request(f"p{i}-{time.monotonic_ns()}", p, params)
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    wall = time.perf_counter() - started
    after = engine.stats()
    pol_a, pol_b = after.policy_stats, before.policy_stats
    prompt = sum(len(p) for p, _ in work)
    return {
        "seconds": wall,
        "tokens_per_s": sum(len(p) + n for p, n in work) / wall,
        "recomputed_tokens": float(after.prompt_tokens - before.prompt_tokens - prompt),
        "preempted_tokens": float(after.preempted_tokens - before.preempted_tokens),
        "preemptions": float(after.num_preemptions - before.num_preemptions),
        "transitions": pol_a.get("transitions", 0.0) - pol_b.get("transitions", 0.0),
        "swap_stall_seconds": pol_a.get("swap_stall_seconds", 0.0)
        - pol_b.get("swap_stall_seconds", 0.0),
    }


def summarise(passes: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Mean, standard deviation, min and max of every figure over the repetitions."""
    out = {}
    for key in passes[0]:
        xs = [p[key] for p in passes]
        sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
        out[key] = {"mean": statistics.fmean(xs), "stdev": sd, "min": min(xs), "max": max(xs)}
    return out


def run_pressure(args: argparse.Namespace, make_model: Any, workloads: Any, out: Path) -> None:
    from gearshift.worker.config import EngineConfig
    from gearshift.worker.launch import start_engine

    work = workloads(args)
    longest = max(len(p) + n for items in work.values() for p, n in items)
    max_len = -(-longest // 16) * 16
    if args.device_kv_tokens < max_len or args.host_kv_tokens < max_len:
        raise SystemExit(
            f"--device-kv-tokens and --host-kv-tokens must hold the longest request ({max_len})"
        )
    per_token = args.layers * KV_BYTES_PER_LAYER_TOKEN  # per rank (either layout splits KV in 2)
    layouts = pressure_layouts(args.host_kv_tokens * 2 * per_token)
    for wname, items in work.items():
        total = sum(len(p) + n for p, n in items)
        print(f"{wname}: {len(items)} requests, {total} KV tokens; device "
              f"{args.device_kv_tokens}, host {args.host_kv_tokens} tokens")  # fmt: skip
    runs: dict[str, dict[str, list[dict[str, float]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_model(Path(tmp) / "model", args.layers)
        config = EngineConfig(
            model=str(folder),
            dtype="float32",
            skip_tokenizer_init=True,
            max_model_len=max_len,
            kv_cache_bytes=args.device_kv_tokens * per_token,
            max_num_batched_tokens=args.batched_tokens,
            enable_prefix_caching=False,
        )
        # Interleaved: every layout once per repetition, so load drifts hit all alike. One
        # group per process at a time (torch.distributed's default group): each layout's group
        # starts, warms up, runs both workloads and stops within its turn.
        for rep in range(args.repetitions):
            for name, policy in layouts.items():
                engine = start_engine(config, json.dumps(policy))
                try:
                    for wname, items in work.items():
                        pressure_pass(engine, items[: max(2, len(items) // 4)])  # warm-up
                        r = pressure_pass(engine, items)
                        runs.setdefault(wname, {}).setdefault(name, []).append(r)
                        print(f"{wname:14s} rep {rep} {name:14s} {r['tokens_per_s']:8.1f} tok/s "
                              f"transitions {r['transitions']:.0f} recomputed "
                              f"{r['recomputed_tokens']:.0f} stall "
                              f"{r['swap_stall_seconds']:.2f}s", flush=True)  # fmt: skip
                finally:
                    engine.shutdown()
    results = {w: {n: summarise(ps) for n, ps in by.items()} for w, by in runs.items()}
    ratios = {}
    for w, by in runs.items():
        best = max(("TP 2", "PP 2"), key=lambda n: results[w][n]["tokens_per_s"]["mean"])
        per_rep = [
            s["tokens_per_s"] / b["tokens_per_s"]
            for s, b in zip(by["Seesaw P2->T2"], by[best], strict=True)
        ]
        ratios[w] = {"best_static": best, **summarise([{"ratio": r} for r in per_rep])["ratio"]}
        print(f"{w}: Seesaw / {best} {ratios[w]['mean']:.2f}x "
              f"(min {ratios[w]['min']:.2f}, max {ratios[w]['max']:.2f})")  # fmt: skip
    record = {
        "command": "python benchmarks/seesaw.py --pressure "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": torch.get_num_threads(),
        },
        "note": args.note,
        "results": results,
        "seesaw_over_best_static": ratios,
    }
    out.write_text(json.dumps(record, indent=2))
    print("wrote", out)
