"""Seesaw under host-store pressure (issue 29): a device KV cache and a host store both smaller
than the workload, against the static layouts of the same 2 ranks with the same device KV.

Reports, per layout and workload, the mean and spread over interleaved repetitions of tokens/s,
gear transitions, recomputed prefill tokens (prefilled less prompt tokens: the engine's own
counts), preempted tokens and the swap-stall seconds (the engine had nothing to run but swap-ins
outstanding). Each static layout's phase speeds are measured in its turn too (prefill-only and
decode-only passes): the report says whether Seesaw's premise (§3: PP prefills faster, TP decodes
faster) holds on this host, the regime where a gear switch can win. Run through
``benchmarks/seesaw.py --pressure`` (``--quick`` for a short check).
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


def drive(
    engine: Any, work: list[tuple[list[int], int]], tag: str
) -> tuple[float, dict[str, list[float]]]:
    """Submit ``work`` (prompt, output tokens: greedy, exactly that many) and step the engine
    until it is done: the wall seconds, and per Seesaw phase ``[seconds, steps]`` (the gear
    that ran each step; a static layout's steps fall in neither)."""
    from gearshift.worker.sampling.params import SamplingParams

    for i, (p, out_len) in enumerate(work):
        params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
        engine.add_request(f"{tag}{i}-{time.monotonic_ns()}", p, params)
    phase = {"prefill": [0.0, 0.0], "decode": [0.0, 0.0]}
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        gear = engine.stats().gear
        if gear in phase:
            phase[gear][0] += time.perf_counter() - t0
            phase[gear][1] += 1
    return time.perf_counter() - started, phase


def pressure_pass(engine: Any, work: list[tuple[list[int], int]]) -> dict[str, float]:
    before = engine.stats()
    wall, phase = drive(engine, work, "p")
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
        "reshard_seconds": pol_a.get("reshard_seconds", 0.0) - pol_b.get("reshard_seconds", 0.0),
        "prefill_phase_seconds": phase["prefill"][0],
        "prefill_phase_steps": phase["prefill"][1],
        "decode_phase_seconds": phase["decode"][0],
        "decode_phase_steps": phase["decode"][1],
    }


def gear_pass(engine: Any, prompts: list[list[int]], out_len: int) -> float:
    """Tokens/s of one phase on a static layout: prefill (``out_len`` 1: prompt tokens/s) or
    decode (short prompts, ``out_len`` tokens each: generated tokens/s)."""
    wall, _ = drive(engine, [(p, out_len) for p in prompts], "g")
    return (sum(len(p) for p in prompts) if out_len == 1 else len(prompts) * out_len) / wall


def explain(ratio: dict[str, float], bound: dict[str, Any]) -> str:
    """What the measured phase speeds say of Seesaw on this host, in words."""
    pre, dec = ratio["prefill_pp2_over_tp2"], ratio["decode_tp2_over_pp2"]
    ceiling = bound["ideal_over_best_static"]
    speeds = f"PP 2 prefills {pre:.2f}x as fast as TP 2, TP 2 decodes {dec:.2f}x as fast as PP 2"
    if pre <= 1 or dec <= 1:
        return (
            f"{speeds}: Seesaw's premise (§3) does not hold here, a gear switch buys no speed "
            "and costs its re-shard and swaps (benchmarks/projections.py projects the paper's "
            "hardware)"
        )
    return (
        f"{speeds}. At those speeds, with switches that cost nothing, Seesaw would run the "
        f"prefill-heavy work at {ceiling:.2f}x the best static layout ({bound['best_static']}): "
        f"the most it can gain here. Its phases took "
        f"{bound['measured_prefill_phase_seconds']:.2f} s of prefill (ideal "
        f"{bound['ideal_prefill_seconds']:.2f} s) and {bound['measured_decode_phase_seconds']:.2f}"
        f" s of decode (ideal {bound['ideal_decode_seconds']:.2f} s) in "
        f"{bound['measured_decode_phase_steps']:.0f} decode steps. Of the gap, re-shards took "
        f"{bound['measured_reshard_seconds']:.2f} s and swap stalls "
        f"{bound['measured_swap_stall_seconds']:.2f} s; the rest (pipeline drains at phase ends, "
        "decode batches bounded by the host store, longer contexts than the decode pass's) is "
        "not broken down"
    )


def regime(
    gears: dict[str, dict[str, list[float]]],
    work: list[tuple[list[int], int]],
    results: dict[str, dict[str, dict[str, float]]],
) -> dict[str, Any]:
    """Whether Seesaw's premise holds on this host (§3: PP prefills faster, TP decodes faster),
    from each static layout's measured phase speeds: mean and spread per phase and layout; and
    for the prefill-heavy ``work``, the time Seesaw would take at those speeds with free
    switches (its prompts at PP 2's prefill speed, its decode tokens at TP 2's decode speed)
    beside what its phases took (``results``, the prefill-heavy figures)."""
    phase = {
        name: {key: summarise([{"x": v} for v in vs])["x"] for key, vs in by.items()}
        for name, by in gears.items()
    }
    pp, tp = phase["PP 2"], phase["TP 2"]
    ratio = {
        "prefill_pp2_over_tp2": pp["prefill_tokens_per_s"]["mean"]
        / tp["prefill_tokens_per_s"]["mean"],
        "decode_tp2_over_pp2": tp["decode_tokens_per_s"]["mean"]
        / pp["decode_tokens_per_s"]["mean"],
    }
    pp_prefills, tp_decodes = ratio["prefill_pp2_over_tp2"] > 1, ratio["decode_tp2_over_pp2"] > 1
    prompt = sum(len(p) for p, _ in work)
    decode = sum(n - 1 for _, n in work)  # the first token comes with the prefill
    ideal_prefill = prompt / pp["prefill_tokens_per_s"]["mean"]
    ideal_decode = decode / tp["decode_tokens_per_s"]["mean"]
    best = max(("TP 2", "PP 2"), key=lambda n: results[n]["tokens_per_s"]["mean"])
    seesaw = results["Seesaw P2->T2"]
    bound = {
        "ideal_prefill_seconds": ideal_prefill,
        "ideal_decode_seconds": ideal_decode,
        "measured_prefill_phase_seconds": seesaw["prefill_phase_seconds"]["mean"],
        "measured_decode_phase_seconds": seesaw["decode_phase_seconds"]["mean"],
        "measured_decode_phase_steps": seesaw["decode_phase_steps"]["mean"],
        "measured_reshard_seconds": seesaw["reshard_seconds"]["mean"],
        "measured_swap_stall_seconds": seesaw["swap_stall_seconds"]["mean"],
        "best_static": best,
        "best_static_seconds": results[best]["seconds"]["mean"],
        "ideal_over_best_static": results[best]["seconds"]["mean"] / (ideal_prefill + ideal_decode),
    }
    exists = pp_prefills and tp_decodes
    why = explain(ratio, bound)
    return {
        "exists": exists,
        "phases": phase,
        "ratios": ratio,
        "prefill_heavy_bound": bound,
        "why": why,
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
    # Each static layout's phase speeds (the Seesaw gears' own layouts): prefill-only passes of
    # the prefill-heavy prompts, decode passes of short prompts that fit the device KV.
    gears: dict[str, dict[str, list[float]]] = {}
    g = torch.Generator().manual_seed(2)
    batch = max(2, min(16, args.device_kv_tokens // 64))  # all fit the device KV: no preemption
    decode_prompts = [torch.randint(10, 49000, (16,), generator=g).tolist() for _ in range(batch)]
    decode_len = min(64, args.device_kv_tokens // batch - 32)
    prefill_prompts = [p for p, _ in work["prefill-heavy"]]
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
                    if name in ("TP 2", "PP 2"):
                        by = gears.setdefault(name, {})
                        pre = gear_pass(engine, prefill_prompts, 1)
                        dec = gear_pass(engine, decode_prompts, decode_len)
                        by.setdefault("prefill_tokens_per_s", []).append(pre)
                        by.setdefault("decode_tokens_per_s", []).append(dec)
                        print(f"phases         rep {rep} {name:14s} prefill {pre:8.1f} tok/s, "
                              f"decode {dec:6.1f} tok/s", flush=True)  # fmt: skip
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
    here = regime(gears, work["prefill-heavy"], results["prefill-heavy"])
    print("regime exists here:", here["exists"], "-", here["why"])
    b = here["prefill_heavy_bound"]
    print(f"prefill-heavy at the measured phase speeds with free switches: "
          f"{b['ideal_prefill_seconds']:.2f} s prefill + {b['ideal_decode_seconds']:.2f} s decode "
          f"= {b['ideal_over_best_static']:.2f}x {b['best_static']}; Seesaw's phases took "
          f"{b['measured_prefill_phase_seconds']:.2f} s + "
          f"{b['measured_decode_phase_seconds']:.2f} s "
          f"({b['measured_decode_phase_steps']:.0f} decode steps)")  # fmt: skip
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
        "regime": here,
    }
    out.write_text(json.dumps(record, indent=2))
    print("wrote", out)
