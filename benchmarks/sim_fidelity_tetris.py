"""Tetris's simulation against the real Tetris group on this machine (issue 16, "each new policy
once it exists"): the same trace through a running group (2 prefill instances of TP 1, one
decode instance of TP 1, gloo) and through ``operator/sim/tetris_sim.py``, predicted vs measured.

Both sides plan every request with the router's planner (Algorithm 1, ``plan_request``) over a
pool whose queues advance by Eq. (2) and take each plan's bookings, from the same arrival times,
so both run the same chunk plans; the real group gets each plan as the router would send it
(``WorkerGenerateRequest.tetris_plan``). The simulator's inputs are measured here first:

* Eq. (1) per SP size from the running group's own pool (``TetrisGroup.profile``, what
  ``gearshift tetris-profile --worker`` calls);
* the decode instance's step cost from ``gearshift profile``'s measurement of a one-rank engine
  of the same model and settings;
* the hand-off: the group's KV bytes per token over a loopback link of ``--link-gbps`` with
  ``--link-ms`` latency (specified, not measured).

    python benchmarks/sim_fidelity_tetris.py            # → sim_fidelity_tetris.json, ~2 min
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from sim_fidelity import (  # noqa: E402
    compare,
    engine_config,
    measured_figures,
    random_llama,
    simulated,
)


def main() -> None:
    from gearshift.operator.commands.tetris_profile import fit
    from gearshift.operator.planner.cdsp import PlannerRules, plan_request
    from gearshift.operator.planner.instance_pool import Pool
    from gearshift.operator.planner.latency_model import LatencyModel
    from gearshift.operator.sim.arrivals import Arrivals, RateCurve
    from gearshift.operator.sim.lengths import LogNormal
    from gearshift.operator.sim.profile import ProfileGrid, measure
    from gearshift.operator.sim.replica import ReplicaConfig
    from gearshift.operator.sim.tetris_sim import TetrisGroupSim, simulate_tetris
    from gearshift.operator.sim.workload import synthesize
    from gearshift.v1 import worker_pb2
    from gearshift.worker.launch import GroupConfig, start_engine
    from gearshift.worker.policies.registry import make_policy
    from gearshift.worker.policies.tetris.group import start_tetris
    from gearshift.worker.sampling.params import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--rate", type=float, default=1.5, help="Poisson req/s")
    ap.add_argument("--prompt-median", type=int, default=200)
    ap.add_argument("--prompt-p90", type=int, default=450)
    ap.add_argument("--improvement-rate", type=float, default=0.3)
    ap.add_argument("--link-gbps", type=float, default=2.0, help="hand-off bandwidth, GB/s")
    ap.add_argument("--link-ms", type=float, default=1.0, help="hand-off latency, ms")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=HERE / "sim_fidelity_tetris.json")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = str(random_llama(Path(tmp), hidden=256, layers=4))
        config = engine_config(model, 1, kv_cache_bytes=64 << 20)
        # The decode instance's step cost: a one-rank engine of the same settings, alone.
        engine = start_engine(config)
        grid = ProfileGrid(
            prompt_lens=(16, 64),
            prefill_batches=(1,),
            decode_batches=(1, 2, 4, 8),
            contexts=(32, 256, 600),
            decode_steps=5,
            repeats=2,
        )
        decode_cost = measure(engine, grid, args.seed).model({"model": "random-llama"})
        replica = ReplicaConfig(
            num_blocks=engine.blocks.num_blocks,
            block_size=engine.blocks.block_size,
            max_num_seqs=engine.scheduler.config.max_num_seqs,
            max_num_batched_tokens=engine.scheduler.config.max_num_batched_tokens,
            max_model_len=engine.max_model_len,
        )
        engine.shutdown()

        outputs: queue.Queue[tuple[str, Any, float]] = queue.Queue()
        policy = make_policy({"tetris": {"prefill_instances": 2, "decode_instances": 1}})
        group = start_tetris(
            config,
            policy,  # type: ignore[arg-type]
            GroupConfig(timeout_s=300),
            lambda rid, item: outputs.put((rid, item, time.perf_counter())),
        )
        try:
            t0 = time.perf_counter()
            samples = group.profile([], [0, 128, 256], [32, 96, 192, 320], 4)
            profile_s = time.perf_counter() - t0
            by_sp: dict[int, list[tuple[int, int, float]]] = {}
            for sp, c, n, seconds in samples:
                by_sp.setdefault(sp, []).append((c, n, seconds))
            fitted = fit(by_sp)
            models = {
                int(m["sp"]): LatencyModel(int(m["sp"]), m["a"], m["b"], m["c"], m["d"])
                for m in fitted
            }
            rules = PlannerRules(models, chunk_granularity=32, max_chunks=3)
            trace = synthesize(
                args.requests,
                Arrivals(RateCurve.constant(args.rate)),
                LogNormal.from_median_p90(args.prompt_median, args.prompt_p90, 32, 900),
                LogNormal.from_median_p90(24, 60, 2, 100),
                args.seed,
            )
            # The router's planning, once, from the arrival times (both sides run these plans).
            pool = Pool.uniform([0.0, 0.0], 8)
            at = 0.0
            plans = []
            for r in trace:
                pool = pool.advance(r.arrival_s - at)
                at = r.arrival_s
                plan = plan_request(r.prompt_tokens, pool, rules, args.improvement_rate)
                pool = pool.commit((c.group, c.end) for c in plan.chunks)
                plans.append(plan)
            measured = _run(group, trace, plans, outputs, worker_pb2, SamplingParams)
            # The members' own prefill seconds against Eq. (1)'s for the same chunks (queueing
            # excluded on both sides): how much slower the pool ran while the decode instance
            # decoded beside it than when it was profiled alone.
            pool_s = group.stats()["prefill_seconds_sum"]
            planned_s = sum(c.seconds for p in plans for c in p.chunks)
            sim_group = TetrisGroupSim(
                prefill=2,
                decode=1,
                rules=rules,
                improvement_rate=args.improvement_rate,
                config=replica,
                decode_cost=decode_cost,
                kv_bytes_per_token=group.row_bytes,
                link_bandwidth=args.link_gbps * 1e9,
                link_latency=args.link_ms / 1e3,
                # The group's 3 ranks share this machine's cores.
                host_cores=len(os.sched_getaffinity(0)),
            )
            t0 = time.perf_counter()
            result = simulate_tetris(sim_group, trace)
            sim_s = time.perf_counter() - t0
            # The same, as if each rank had a core (a device) of its own: what contention costs.
            own = simulate_tetris(dataclasses.replace(sim_group, host_cores=None), trace)
        finally:
            group.shutdown()

    rows = compare(measured, simulated(result))
    print("as if each rank had a core of its own:")
    rows_own = compare(measured, simulated(own))
    chunks = statistics.mean(len(p.chunks) for p in plans)
    print(
        f"profile {profile_s:.1f} s ({len(samples)} points); simulation {sim_s * 1000:.1f} ms; "
        f"{chunks:.2f} chunks per request; rejected in simulation: {len(result.rejected)}; "
        f"the pool's prefills took {pool_s / planned_s:.2f}x Eq. (1)'s estimate"
    )
    out = {
        "command": "python " + " ".join(sys.argv),
        "latency_models": fitted,
        "decode_cost": {
            "prefill": vars(decode_cost.prefill),
            "decode": vars(decode_cost.decode),
            "decode_scale": decode_cost.decode_scale,
        },
        "host_cores": sim_group.host_cores,
        "chunks_per_request": chunks,
        "pool_prefill_seconds": pool_s,
        "eq1_prefill_seconds": planned_s,
        "rows": rows,
        "rows_a_core_per_rank": rows_own,
    }
    args.out.write_text(json.dumps(out, indent=2) + "\n")


def _run(group, trace, plans, outputs, worker_pb2, SamplingParams) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Replay ``trace`` in real time through the group with ``plans``; the measured figures."""
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count: dict[str, int] = {}
    ended: set[str] = set()
    start = time.perf_counter()
    pending = list(enumerate(zip(trace, plans, strict=True)))
    while pending or len(ended) < len(trace):
        now = time.perf_counter() - start
        while pending and pending[0][1][0].arrival_s <= now:
            i, (r, plan) = pending.pop(0)
            wire = worker_pb2.TetrisPlan(decode_instance=0, planned_prefill_seconds=plan.ttft)
            for c in plan.chunks:
                wire.chunks.add(num_tokens=c.length, prefill_instances=c.group)
            params = SamplingParams(temperature=0.0, max_tokens=r.output_tokens, ignore_eos=True)
            ids = [(7 * i + k) % 1000 for k in range(r.prompt_tokens)]
            group.submit(f"r{i}", ids, params, wire)
        wait = 0.05 if not pending else max(0.0, pending[0][1][0].arrival_s - now)
        try:
            rid, item, t = outputs.get(timeout=min(0.05, wait) or 0.001)
        except queue.Empty:
            continue
        if isinstance(item, BaseException):
            raise SystemExit(f"{rid} failed: {item}")
        t -= start
        if item.new_token_ids:
            first.setdefault(rid, t)
            last[rid] = t
            count[rid] = count.get(rid, 0) + len(item.new_token_ids)
        if item.finished:
            ended.add(rid)
    return measured_figures(trace, first, last, count)


if __name__ == "__main__":
    main()
