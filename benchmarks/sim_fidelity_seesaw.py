"""Seesaw's simulation against a real Seesaw engine on this machine (issue 16, "each new policy
once it exists"): P2 prefill -> T2 decode on 2 CPU ranks (gloo), the same trace through the
running engine and through ``operator/sim/seesaw_sim.py`` (the engine's own Seesaw leader in
simulated time), predicted vs measured.

The simulator's prices (``seesaw_sim.Measured``) are measured here first, same model and settings:

* the prefill gear's step: ``gearshift profile`` of a static PP 2 engine (one micro-batch at a
  time: the whole traversal, which the simulator spreads over the 2 stages);
* the decode gear's step: ``gearshift profile`` of a static TP 2 engine;
* one re-shard and one KV block's host copy each way: a warm-up trace through the Seesaw engine
  (its ``reshard_seconds`` per transition; its synchronous swap-in seconds over the bytes swapped
  in; the leader rank's swap-out seconds over the bytes swapped out, which include the barrier a
  synchronous swap-out takes and first writes to the store's pages);
* the host store's pages from the policy's ``hostKvCapacityBytes``; KV writes add to their step
  (``asyncSwap: false``: the CPU hook writes before the step runs).

    python benchmarks/sim_fidelity_seesaw.py            # → sim_fidelity_seesaw.json, ~2 min
    python benchmarks/sim_fidelity_seesaw.py --oos      # out of sample (benchmarks/fidelity_oos.py)
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from sim_fidelity import (  # noqa: E402
    add_oos_args,
    compare,
    engine_config,
    fidelity_oos,
    fidelity_trace,
    profile_grid,
    random_llama,
    replay,
    run_engine,
    simulated,
)

HOST_BYTES = 64 << 20


def seesaw_policy() -> dict[str, Any]:
    return {
        "seesaw": {
            "prefill": {"tp": 1, "pp": 2},
            "decode": {"tp": 2, "pp": 1},
            "hostKvCapacityBytes": HOST_BYTES,
            "asyncSwap": False,
        }
    }


def simulation(model, engine, costs, warm_stats, out_seconds):  # type: ignore[no-untyped-def]
    """The simulated engine, priced by the profiles and the warm-up's measured copies and
    re-shards: (deployment, prices)."""
    from gearshift.operator.sim import model_desc
    from gearshift.operator.sim.replica import ReplicaConfig
    from gearshift.operator.sim.seesaw_sim import Measured, SeesawHooks
    from gearshift.operator.sim.simulator import Deployment

    block_size = engine.blocks.block_size
    replica = ReplicaConfig(
        num_blocks=engine.blocks.num_blocks,
        block_size=block_size,
        max_num_seqs=engine.scheduler.config.max_num_seqs,
        max_num_batched_tokens=engine.scheduler.config.max_num_batched_tokens,
        max_model_len=engine.max_model_len,
    )
    desc = model_desc.load(model)
    block_bytes = desc.kv_bytes_per_token() * block_size
    swapped_in = warm_stats["swap_in_bytes"]
    copy_in_block_s = (
        warm_stats["swap_wait_seconds"] / swapped_in * block_bytes if swapped_in else 0.0
    )
    swapped_out = warm_stats["swap_out_bytes"]
    copy_out_block_s = out_seconds / swapped_out * block_bytes if swapped_out else 0.0
    transitions = max(warm_stats["transitions"], 1.0)
    prices = Measured(
        prefill=costs["prefill"],
        decode=costs["decode"],
        copy_in_block_s=copy_in_block_s,
        reshard_s=warm_stats["reshard_seconds"] / transitions,
        host_pages=HOST_BYTES // block_bytes,
        overlap_out=False,
        copy_out_block_s=copy_out_block_s,
    )
    hooks = functools.partial(SeesawHooks, desc, None, 2, block_size, measured=prices)
    # The prefill gear's 2 stages hold each step by its work on them (the LM head, on the
    # last, only for the rows that sample).
    deployment = Deployment(
        1, replica, costs["decode"], hooks=hooks, stage_shares=desc.stage_shares(2)
    )
    return deployment, prices


def out_of_sample(args, engine, deployment) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """Every validation trace through the warm Seesaw engine and the simulation."""
    from gearshift.operator.sim.simulator import simulate

    oos = fidelity_oos()
    return oos.run(
        oos.scenarios(args.oos_lengths, args.oos_arrivals, args.oos_seeds),
        args.oos_requests,
        args.oos_rate,
        lambda trace: oos.engine_records(trace, *replay(engine, trace)),
        lambda trace: oos.sim_records(simulate(deployment, trace)),
    )


def _plain(value: Any) -> Any:
    """JSON for the prices' cost models."""
    return {k: v for k, v in vars(value).items() if not k.startswith("_")}


def main() -> None:
    from gearshift.operator.sim.arrivals import Arrivals, RateCurve
    from gearshift.operator.sim.lengths import LogNormal
    from gearshift.operator.sim.profile import measure
    from gearshift.operator.sim.simulator import simulate
    from gearshift.operator.sim.trace import TraceRequest
    from gearshift.operator.sim.workload import synthesize
    from gearshift.worker.launch import start_engine
    from gearshift.worker.policies.registry import make_policy

    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rate", type=float, default=0.0, help="Poisson req/s; 0: offline")
    ap.add_argument("--kv-bytes", type=int, default=4 << 20, help="device KV per rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--out", type=Path, default=None, help="default: sim_fidelity_seesaw[_oos].json"
    )
    add_oos_args(ap)
    args = ap.parse_args()
    if args.out is None:
        args.out = HERE / (
            "sim_fidelity_seesaw_oos.json" if args.oos else "sim_fidelity_seesaw.json"
        )
    if args.cpu_clock:
        raise SystemExit("--cpu-clock times one rank: Seesaw runs two")

    grid = profile_grid()
    with tempfile.TemporaryDirectory() as tmp:
        model = str(random_llama(Path(tmp), hidden=256, layers=4))
        config = engine_config(model, 1, kv_cache_bytes=args.kv_bytes)
        costs = {}
        t0 = time.perf_counter()
        for name, layout in (("prefill", {"pp": 2}), ("decode", {"tp": 2})):
            engine = start_engine(config, make_policy({"static": layout}))
            try:
                costs[name] = measure(engine, grid, args.seed).model({"layout": layout})
            finally:
                engine.shutdown()
        profile_s = time.perf_counter() - t0

        trace = fidelity_trace(args.requests, args.rate, args.seed)
        arrivals = Arrivals(RateCurve.constant(1.0))
        warm = synthesize(
            16,
            arrivals,
            LogNormal.from_median_p90(200, 500, 8, 700),
            LogNormal.from_median_p90(30, 80, 2, 120),
            args.seed + 1,
        )
        warm = [TraceRequest(0.0, r.prompt_tokens, r.output_tokens) for r in warm]

        engine = start_engine(config, make_policy(seesaw_policy()))
        try:
            run_engine(engine, warm)
            warm_stats = dict(engine.policy.stats())
            # The leader rank's hook (this process): its swap work, re-shards included.
            hook = engine.policy.hook
            assert hook is not None
            c = hook.counters
            # The swap-outs' own work: a synchronous swap-out's barrier wait is not in the
            # block's price (the simulator drains the pipeline before such a step instead).
            out_seconds = c.seconds - c.sync_in_seconds - sum(c.reshards) - c.out_barrier_seconds
            deployment, prices = simulation(model, engine, costs, warm_stats, out_seconds)
            if args.oos:
                report = {
                    "command": "python " + " ".join(sys.argv),
                    "policy": seesaw_policy(),
                    "profile_s": profile_s,
                    "prices": vars(prices),
                    "warm_stats": warm_stats,
                    **out_of_sample(args, engine, deployment),
                }
            else:
                measured = run_engine(engine, trace)
            stats = dict(engine.policy.stats())
            blocks = engine.blocks.num_blocks
            block_size = engine.blocks.block_size
        finally:
            engine.shutdown()
        if args.oos:
            args.out.write_text(json.dumps(report, indent=2, default=_plain) + "\n")
            return
        copy_in_block_s, copy_out_block_s = prices.copy_in_block_s, prices.copy_out_block_s
        t0 = time.perf_counter()
        result = simulate(deployment, trace)
        sim_s = time.perf_counter() - t0
        predicted = simulated(result)

    rows = compare(measured, predicted)
    run_transitions = stats["transitions"] - warm_stats["transitions"]
    print(
        f"profile {profile_s:.1f} s; device KV {blocks} blocks of {block_size}; re-shard "
        f"{prices.reshard_s * 1e3:.1f} ms, a block's copy in {copy_in_block_s * 1e6:.1f} us, out "
        f"{copy_out_block_s * 1e6:.1f} us; "
        f"transitions: run {run_transitions:.0f}; simulation {sim_s * 1e3:.1f} ms"
    )
    out = {
        "command": "python " + " ".join(sys.argv),
        "policy": seesaw_policy(),
        "prices": {
            "prefill": vars(costs["prefill"].prefill),
            "prefill_decode_steps": vars(costs["prefill"].decode),
            "decode": vars(costs["decode"].decode),
            "decode_scale": costs["decode"].decode_scale,
            "prefill_decode_scale": costs["prefill"].decode_scale,
            "decode_prefill_steps": vars(costs["decode"].prefill),
            "copy_in_block_s": copy_in_block_s,
            "copy_out_block_s": copy_out_block_s,
            "reshard_s": prices.reshard_s,
            "host_pages": prices.host_pages,
        },
        "device_blocks": blocks,
        "run_stats": stats,
        "rows": rows,
    }
    args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
