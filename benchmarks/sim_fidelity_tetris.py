"""Tetris's simulation against the real Tetris group on this machine (issue 16, "each new policy
once it exists"): the same trace through a running group (2 prefill instances of TP 1, one
decode instance of TP 1, gloo) and through ``operator/sim/tetris_sim.py``, predicted vs measured.

Both sides plan every request with the router's planner (Algorithm 1, ``plan_request``) over a
pool whose queues advance by Eq. (2) and take each plan's bookings, from the same arrival times,
so both run the same chunk plans; the real group gets each plan as the router would send it
(``WorkerGenerateRequest.tetris_plan``). The simulator's inputs are measured here first:

* Eq. (1) per SP size from the running group's own pool (``TetrisGroup.profile``, what
  ``gearshift tetris-profile --worker`` calls), on an idle group;
* nothing for the ranks' sharing of this machine's cores: the simulator derives it
  (``host_cores`` with ``host_gangs``, ``operator/sim/shared_cores.py``). To check that model the
  pool is profiled again while the decode instance decodes 8 requests beside it, and the script
  prints each SP size's busy over idle Eq. (1) (the model says 1 for SP 1, 2.25 for SP 2);
* the decode instance's step cost from ``gearshift profile``'s measurement of a one-rank engine
  of the same model and settings, plus what the decode instance adds to each step (its leader
  lands KV and admits requests too), measured on the idle group: batches of 1, 2, 4 and 8
  requests, 3 of each, each batch's median step less the profiled step, the median of the 3
  (``cost_model.StepOverhead``);
* what landing a piece adds to the decode step that receives it (``_measure_receive``): 8
  requests decode while single requests of 24, 128, 320 and 800 prompt tokens arrive one at a
  time (5 each); the step before each one's first token is the one that landed its KV, and its
  length less the load's usual step is the receive's. The median at each size is fitted as a
  latency plus the KV bytes over a bandwidth (``TetrisGroupSim.receive_latency``,
  ``receive_bandwidth``): a decode instance busy with a batch pays it in that step, and so does
  every request in the batch;
* the hand-off, measured on the idle group (``_measure_handoff``): single requests of 64, 320
  and 800 prompt tokens on one instance, each request's TTFT less its member's prefill seconds,
  its first decode step (the profiled cost) and the receive above, the median at each size
  fitted as a latency plus the KV bytes over a bandwidth. That is what a request spends outside
  compute between arriving and its first token besides the receive (the pipes, the handshake,
  the KV's trip), priced where the simulator puts the hand-off, before the step that receives
  it. ``--link-gbps`` and ``--link-ms`` give it instead.

* how much slower the pool computes beside other ranks (``_measure_beside``): the SP 1 part of
  the profile grid again while the decode instance decodes 8 requests, and SP 1 chunks of each
  grid length on both instances at once (each instance's own time, 5 each) against one at a
  time; each point's median over its median alone, and the median of all those
  (``TetrisGroupSim.pool_beside``). Either way two ranks compute on two cores, so no core is
  shared: what it measures is the caches, memory bandwidth and clock they do share. The simulator
  slows every pool chunk by it while another rank computes beside it; the same runs are also
  priced without it (``no_beside``).

The simulator prices each piece's hand-off as one rank's work on the pool's cores
(``TetrisGroupSim.handoff_is_work``): on this build the sends, the pipes and the handshake are
computed by the group's processes on the same cores. The same runs are also priced with the
hand-off as a wait that takes no core (``handoff_wait``).

The simulator also holds each piece's transfer slot (two here, one per prefill instance) from
its grant until the decode step that received it has ended, as the engine does. A freed slot's
next piece reaches the decode instance once its next step has begun, so a burst of prompts
that prefill faster than a decode step lands about one a step.

The same run also simulates plain processor sharing (rings not in lock step) and a core per
rank, for comparison.

``--pin`` pins the group's ranks apart once they have started: every prefill rank to the first
core, the decode instance's rank to the others (each thread, ``sched_setaffinity``), and the
simulator is told so (``TetrisGroupSim.pool_cores``: the decode steps take their profiled cost,
the pool's chunks share one core). Unpinned, three busy ranks on two cores do not share them
evenly: the kernel keeps one rank on a core of its own and two on the other, and which two
changes from run to run, so the decode steps of a run can take 2-3x their profiled cost while
another rank runs at full speed (``benchmarks/README.md``, Tetris out of sample).

    python benchmarks/sim_fidelity_tetris.py            # → sim_fidelity_tetris.json, ~1 min
    python benchmarks/sim_fidelity_tetris.py --oos      # out of sample (benchmarks/fidelity_oos.py)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import os
import queue
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from sim_fidelity import (  # noqa: E402
    add_oos_args,
    compare,
    decode_batch,
    engine_config,
    fidelity_oos,
    measured_figures,
    random_llama,
    simulated,
)

PROFILE_HISTORIES, PROFILE_LENGTHS, PROFILE_REPEATS = (0, 128, 256), (32, 96, 192, 320), 4


def decode_profile(config: Any, seed: int) -> tuple[Any, Any]:
    """The decode instance's step cost (a one-rank engine of the same settings, alone) and the
    replica settings the simulator schedules by."""
    from gearshift.operator.sim.profile import ProfileGrid, measure
    from gearshift.operator.sim.replica import ReplicaConfig
    from gearshift.worker.launch import start_engine

    engine = start_engine(config)
    try:
        grid = ProfileGrid(
            prompt_lens=(16, 64),
            prefill_batches=(1,),
            decode_batches=(1, 2, 3, 4, 6, 8, 12, 16),
            contexts=(32, 128, 256, 600, 900),
            decode_steps=5,
            repeats=3,
        )
        cost = measure(engine, grid, seed).model({"model": "random-llama"})
        replica = ReplicaConfig.of_engine(engine)
    finally:
        engine.shutdown()
    return cost, replica


def measure_and_simulate(
    config: Any,
    decode_cost: Any,
    replica: Any,
    trace: list[Any],
    improvement_rate: float,
    link: tuple[float, float] | None = None,
    busy_check: bool = True,
    validate: Any = None,
    pin: bool = False,
) -> dict[str, Any]:
    """Start a Tetris group (2 prefill + 1 decode instances of TP 1), measure the simulator's
    inputs on it, replay ``trace`` through it with the router's plans, and simulate the same;
    ``link``: (bytes/s, s) for the hand-off instead of measuring it; ``busy_check``: also
    profile the pool beside a decoding instance (the gang model's check). ``validate``
    (out of sample): called with a measure and a simulate function of a trace, each giving
    ``fidelity_oos`` records, while the group runs; its answer is ``out["validation"]``, and
    ``trace`` is not run."""
    from gearshift.operator.planner.cdsp import PlannerRules, plan_request
    from gearshift.operator.planner.instance_pool import Pool
    from gearshift.operator.sim.cost_model import StepOverhead
    from gearshift.operator.sim.tetris_sim import TetrisGroupSim, simulate_tetris
    from gearshift.v1 import worker_pb2
    from gearshift.worker.launch import GroupConfig
    from gearshift.worker.launch.tetris.start import start_tetris
    from gearshift.worker.policies.registry import make_policy
    from gearshift.worker.sampling.params import SamplingParams

    out: dict[str, Any] = {}
    outputs: queue.Queue[tuple[str, Any, float]] = queue.Queue()
    policy = make_policy({"tetris": {"prefill_instances": 2, "decode_instances": 1}})
    group = start_tetris(
        config,
        policy,  # type: ignore[arg-type]
        GroupConfig(timeout_s=300),
        lambda rid, item: outputs.put((rid, item, time.perf_counter())),
    )
    try:
        pool_cores = _pin_apart(group, policy) if pin else None
        out["pool_cores"] = pool_cores
        t0 = time.perf_counter()
        samples = group.profile([], PROFILE_HISTORIES, PROFILE_LENGTHS, PROFILE_REPEATS)
        out["profile_s"] = time.perf_counter() - t0
        out["profile_points"] = len(samples)
        out["fitted"], models = _fit(samples)
        out["decode_extra"] = _measure_decode_steps(
            group, outputs, decode_cost, worker_pb2, SamplingParams
        )
        print(f"decode instance's extra per step by batch: {out['decode_extra']}")
        instance_cost = StepOverhead(decode_cost, out["decode_extra"])
        out["receive_points"] = _measure_receive(group, outputs, worker_pb2, SamplingParams)
        receive_bw, receive_lat = out["receive"] = _fit_link(out["receive_points"])
        print(
            f"a piece's receive in a decode step: {receive_bw / 1e9:.3f} GB/s, "
            f"{receive_lat * 1e3:.2f} ms ({len(out['receive_points'])} points)"
        )

        def receive(rows: int) -> float:
            return receive_lat + rows * group.row_bytes / receive_bw

        whole: list[tuple[float, float]] = []
        if link is None:
            link = _measure_handoff(
                group, outputs, instance_cost, worker_pb2, SamplingParams, receive, whole
            )
        bandwidth, latency = out["bandwidth"], out["latency"] = link
        print(f"hand-off: {bandwidth / 1e9:.3f} GB/s, {latency * 1e3:.2f} ms")
        out["beside_points"] = _measure_beside(group, outputs, worker_pb2, SamplingParams, samples)
        out["beside"] = max(1.0, statistics.median(r for *_, r in out["beside_points"]))
        print(
            f"the pool beside other ranks: {out['beside']:.3f}x (SP 1, "
            f"{len(out['beside_points'])} points)"
        )
        if busy_check:
            # The same grid while the decode instance decodes beside the pool: the check of
            # the simulator's lock-step gang model (a chunk on both instances beside a decode
            # step runs at (2/3)² of its speed on 2 cores, 2.25x slower; on one instance, 2
            # ranks busy, at full speed).
            busy = _profile_beside_decode(group, outputs, worker_pb2, SamplingParams)
            out["busy_fitted"], busy_models = _fit(busy)
            out["beside"] = {
                sp: [
                    round(busy_models[sp].seconds(c, n) / models[sp].seconds(c, n), 3)
                    for c in (0, 256)
                    for n in (32, 320)
                ]
                for sp in sorted(models)
            }
            print(f"busy / idle Eq. (1) by SP at C 0/256, L 32/320: {out['beside']}")
        rules = PlannerRules(models, chunk_granularity=32, max_chunks=3)

        def plan(trace: list[Any]) -> list[Any]:
            # The router's planning, once, from the arrival times (both sides run these plans).
            pool = Pool.uniform([0.0, 0.0], 8)
            at = 0.0
            plans = []
            for r in trace:
                pool = pool.advance(r.arrival_s - at)
                at = r.arrival_s
                plan = plan_request(r.prompt_tokens, pool, rules, improvement_rate)
                pool = pool.commit((c.group, c.end) for c in plan.chunks)
                plans.append(plan)
            return plans

        out["row_bytes"] = group.row_bytes
        out["cores"] = len(os.sched_getaffinity(0))
        sim_group = TetrisGroupSim(
            prefill=2,
            decode=1,
            rules=rules,
            improvement_rate=improvement_rate,
            config=replica,
            decode_cost=instance_cost,
            kv_bytes_per_token=out["row_bytes"],
            link_bandwidth=bandwidth,
            link_latency=latency,
            # The group's 3 ranks share this machine's cores, a ring's members in lock step;
            # or pinned apart, the pool on its cores and the decode rank on its own.
            host_cores=out["cores"] if pool_cores is None else None,
            host_gangs=pool_cores is None,
            pool_cores=pool_cores,
            receive_latency=receive_lat,
            receive_bandwidth=receive_bw,
            pool_beside=out["beside"],
        )
        if validate is not None:
            oos = fidelity_oos()

            def measure(trace: list[Any]) -> Any:
                got = _run(group, trace, plan(trace), outputs, worker_pb2, SamplingParams, True)
                return oos.engine_records(trace, *got)

            def simulate(trace: list[Any], group: Any = sim_group) -> Any:
                return oos.sim_records(simulate_tetris(group, trace))

            # The same runs priced as before the slots and the receive were modelled: a slot
            # per request (none waits), the whole hand-off before the step.
            before = dataclasses.replace(
                sim_group,
                transfer_slots=1 << 20,  # more than any trace has requests
                receive_latency=0.0,
                receive_bandwidth=None,
            )
            if whole:
                bw, lat = whole[0]
                before = dataclasses.replace(before, link_bandwidth=bw, link_latency=lat)
                out["handoff_whole"] = whole[0]
            alternatives = {
                "before_slots": functools.partial(simulate, group=before),
                "no_beside": functools.partial(
                    simulate, group=dataclasses.replace(sim_group, pool_beside=1.0)
                ),
                "handoff_wait": functools.partial(
                    simulate, group=dataclasses.replace(sim_group, handoff_is_work=False)
                ),
            }
            out["validation"] = validate(measure, simulate, alternatives)
            return out
        plans = plan(trace)
        out["plans"] = plans
        pool_before = group.stats()["prefill_seconds_sum"]
        out["measured"] = _run(group, trace, plans, outputs, worker_pb2, SamplingParams)
        # The members' own prefill seconds against Eq. (1)'s for the same chunks (queueing
        # excluded on both sides).
        out["pool_s"] = group.stats()["prefill_seconds_sum"] - pool_before
        out["planned_s"] = sum(c.seconds for p in plans for c in p.chunks)
    finally:
        group.shutdown()
    t0 = time.perf_counter()
    out["result"] = simulate_tetris(sim_group, trace)
    out["sim_s"] = time.perf_counter() - t0
    # The same with plain processor sharing (rings not in lock step), and as if each rank had a
    # core (a device) of its own.
    out["shared"] = simulate_tetris(dataclasses.replace(sim_group, host_gangs=False), trace)
    out["own"] = simulate_tetris(
        dataclasses.replace(
            sim_group, host_cores=None, host_gangs=False, pool_cores=None, pool_beside=1.0
        ),
        trace,
    )
    return out


def main() -> None:
    from gearshift.operator.sim.arrivals import Arrivals, RateCurve
    from gearshift.operator.sim.lengths import LogNormal
    from gearshift.operator.sim.workload import synthesize

    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--rate", type=float, default=1.5, help="Poisson req/s")
    ap.add_argument("--prompt-median", type=int, default=200)
    ap.add_argument("--prompt-p90", type=int, default=450)
    ap.add_argument("--improvement-rate", type=float, default=0.3)
    ap.add_argument("--link-gbps", type=float, help="hand-off bandwidth, GB/s (default: measured)")
    ap.add_argument("--link-ms", type=float, help="hand-off latency, ms (default: measured)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--out", type=Path, default=None, help="default: sim_fidelity_tetris[_oos].json"
    )
    ap.add_argument(
        "--pin",
        action="store_true",
        help="pin the pool's ranks to one core and the decode rank to the others (see above)",
    )
    add_oos_args(ap)
    args = ap.parse_args()
    if args.out is None:
        args.out = HERE / (
            "sim_fidelity_tetris_oos.json" if args.oos else "sim_fidelity_tetris.json"
        )
    if args.cpu_clock:
        raise SystemExit("--cpu-clock times one rank: a Tetris group runs three")

    trace = synthesize(
        args.requests,
        Arrivals(RateCurve.constant(args.rate)),
        LogNormal.from_median_p90(args.prompt_median, args.prompt_p90, 32, 900),
        LogNormal.from_median_p90(24, 60, 2, 100),
        args.seed,
    )
    link = None
    if args.link_gbps is not None and args.link_ms is not None:
        link = (args.link_gbps * 1e9, args.link_ms / 1e3)
    with tempfile.TemporaryDirectory() as tmp:
        model = str(random_llama(Path(tmp), hidden=256, layers=4))
        config = engine_config(model, 1, kv_cache_bytes=64 << 20)
        decode_cost, replica = decode_profile(config, args.seed)
        if args.oos:
            oos = fidelity_oos()
            runs = oos.scenarios(args.oos_lengths, args.oos_arrivals, args.oos_seeds)

            def validate(measure: Any, simulate: Any, alternatives: Any) -> Any:
                return oos.run(
                    runs, args.oos_requests, args.oos_rate, measure, simulate, alternatives
                )

            got = measure_and_simulate(
                config,
                decode_cost,
                replica,
                [],
                args.improvement_rate,
                link,
                False,
                validate,
                args.pin,
            )
            report = {
                "command": "python " + " ".join(sys.argv),
                "latency_models": got["fitted"],
                "decode_cost": {
                    "prefill": vars(decode_cost.prefill),
                    "decode": vars(decode_cost.decode),
                    "decode_scale": decode_cost.decode_scale,
                    "decode_instance_extra_by_batch": got["decode_extra"],
                },
                "handoff": {"bandwidth_bytes_per_s": got["bandwidth"], "latency_s": got["latency"]},
                "receive": _receive_json(got),
                "host_cores": got["cores"],
                "pool_cores": got["pool_cores"],
                "pool_beside": _beside_json(got),
                "before_slots_handoff": got.get("handoff_whole"),
                **got["validation"],
            }
            args.out.write_text(json.dumps(report, indent=2, default=_plain) + "\n")
            return
        got = measure_and_simulate(
            config, decode_cost, replica, trace, args.improvement_rate, link, pin=args.pin
        )

    result = got["result"]
    rows = compare(got["measured"], simulated(result))
    print(f"processor sharing over {got['cores']} cores, rings not in lock step:")
    rows_shared = compare(got["measured"], simulated(got["shared"]))
    print("as if each rank had a core of its own:")
    rows_own = compare(got["measured"], simulated(got["own"]))
    chunks = statistics.mean(len(p.chunks) for p in got["plans"])
    print(
        f"profile {got['profile_s']:.1f} s ({got['profile_points']} points); simulation "
        f"{got['sim_s'] * 1000:.1f} ms; {chunks:.2f} chunks per request; rejected in "
        f"simulation: {len(result.rejected)}; the pool's prefills took "
        f"{got['pool_s'] / got['planned_s']:.2f}x Eq. (1)'s estimate"
    )
    out = {
        "command": "python " + " ".join(sys.argv),
        "latency_models": got["fitted"],
        "decode_cost": {
            "prefill": vars(decode_cost.prefill),
            "decode": vars(decode_cost.decode),
            "decode_scale": decode_cost.decode_scale,
            "decode_instance_extra_by_batch": got["decode_extra"],
        },
        "busy_latency_models": got["busy_fitted"],
        "busy_over_idle_by_sp": got["beside"],
        "handoff": {"bandwidth_bytes_per_s": got["bandwidth"], "latency_s": got["latency"]},
        "receive": _receive_json(got),
        "host_cores": got["cores"],
        "pool_cores": got["pool_cores"],
        "pool_beside": _beside_json(got),
        "chunks_per_request": chunks,
        "pool_prefill_seconds": got["pool_s"],
        "eq1_prefill_seconds": got["planned_s"],
        "rows": rows,
        "rows_processor_sharing": rows_shared,
        "rows_a_core_per_rank": rows_own,
    }
    args.out.write_text(json.dumps(out, indent=2) + "\n")


def _receive_json(got: dict[str, Any]) -> dict[str, Any]:
    bandwidth, latency = got["receive"]
    return {
        "bandwidth_bytes_per_s": bandwidth,
        "latency_s": latency,
        "points": got["receive_points"],
    }


def _beside_json(got: dict[str, Any]) -> dict[str, Any]:
    return {
        "factor": got["beside"],
        "points": [
            {"beside": kind, "history": c, "length": n, "alone_s": a, "beside_s": b, "ratio": r}
            for kind, c, n, a, b, r in got["beside_points"]
        ],
    }


def _plain(value: Any) -> Any:
    """A numpy scalar as the Python number it holds (the Eq. (1) fit's counts are numpy's)."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON")


def _pin_apart(group: Any, policy: Any) -> int:
    """Pin every thread of the pool's ranks to this process's first core and the decode
    instance's to the rest (threads started later inherit their starter's); the pool's cores."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("--pin needs two cores: one for the pool, the rest for decoding")
    pool = [r for m in range(policy.prefill) for r in policy.prefill_ranks(m)]
    decode = [r for d in range(policy.decode) for r in policy.decode_ranks(d)]
    for ranks, mask in ((pool, cores[:1]), (decode, cores[1:])):
        for rank in ranks:
            pid = group.procs[rank].pid
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.sched_setaffinity(int(tid), mask)
    return len(cores[:1])


def _fit(samples: list[Any]) -> tuple[list[dict[str, Any]], dict[int, Any]]:
    """Eq. (1) per SP size from a profile's (sp, C, L, seconds) samples: the fitted rows (as
    ``gearshift tetris-profile`` writes them) and the models."""
    from gearshift.operator.commands.tetris_profile import fit
    from gearshift.operator.planner.latency_model import LatencyModel

    by_sp: dict[int, list[tuple[int, int, float]]] = {}
    for sp, c, n, seconds in samples:
        by_sp.setdefault(sp, []).append((c, n, seconds))
    fitted = fit(by_sp)
    models = {
        int(m["sp"]): LatencyModel(int(m["sp"]), m["a"], m["b"], m["c"], m["d"]) for m in fitted
    }
    return fitted, models


def _token_times(
    outputs: Any, rids: list[str], timeout_s: float, started: bool = False
) -> dict[str, list[float]]:
    """When each token of ``rids`` came (perf_counter), once all of them have finished (or
    with ``started``, have their first token)."""
    times: dict[str, list[float]] = {rid: [] for rid in rids}
    done: set[str] = set()
    deadline = time.perf_counter() + timeout_s
    while len(done) < len(rids):
        got = _next_output(
            outputs, deadline, f"{sorted(set(rids) - done)} did not finish in {timeout_s} s"
        )
        if got is None:
            continue
        rid, item, t = got
        if rid not in times:
            continue
        if item.new_token_ids:
            times[rid].append(t)
        if item.finished or (started and times[rid]):
            done.add(rid)
    return times


def _next_output(outputs: Any, deadline: float, late: str) -> tuple[str, Any, float] | None:
    """The group's next output (request id, item, when), or None after a second without one;
    ends the script with ``late`` past ``deadline`` (perf_counter) or naming a failed
    request."""
    if time.perf_counter() > deadline:
        raise SystemExit(late)
    try:
        rid, item, t = outputs.get(timeout=1.0)
    except queue.Empty:
        return None
    if isinstance(item, BaseException):
        raise SystemExit(f"{rid} failed: {item}")
    return rid, item, t


RECEIVE_PROMPTS, RECEIVE_REPEATS = (24, 128, 320, 800), 5
RECEIVE_TICKS = 6  # the load's steps seen before each request is sent


def _measure_receive(group, outputs, worker_pb2, SamplingParams) -> list[tuple[int, float]]:  # type: ignore[no-untyped-def]
    """What landing one piece adds to a decode step, as (KV bytes, seconds): ``BUSY_LOAD``
    requests decode while single requests of ``RECEIVE_PROMPTS`` tokens arrive one at a time.
    The step that lands a request's KV is the one before the step of its first token (its
    last prompt token runs as a decode row); its length less the median of the load's steps
    before it is the receive's."""
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rids = _start_load(group, outputs, worker_pb2, SamplingParams, "rload")
    points = []
    try:
        for n in RECEIVE_PROMPTS:
            for k in range(RECEIVE_REPEATS):
                ticks: list[float] = []  # the load's first request's tokens: the steps' ends
                first = None
                sent = False
                deadline = time.perf_counter() + 60
                while first is None:
                    got = _next_output(
                        outputs, deadline, f"no first token of a {n}-token request in 60 s"
                    )
                    if got is None:
                        continue
                    rid, item, t = got
                    if rid == rids[0] and item.new_token_ids:
                        ticks.append(t)
                    elif rid == f"recv{n}.{k}" and item.new_token_ids:
                        first = t
                    if not sent and len(ticks) >= RECEIVE_TICKS:
                        wire = worker_pb2.TetrisPlan(decode_instance=0)
                        wire.chunks.add(num_tokens=n, prefill_instances=[k % 2])
                        ids = [(5 * k + i) % 1000 for i in range(n)]
                        group.submit(f"recv{n}.{k}", ids, one, wire)
                        sent = True
                # Step ends before the first token's step (its own tick may come either side).
                ends = [t for t in ticks if t < first - 5e-4]
                steps = [b - a for a, b in itertools.pairwise(ends)]
                if len(steps) < RECEIVE_TICKS - 1:
                    continue  # it landed too soon to tell its step from the others
                usual = statistics.median(steps[: RECEIVE_TICKS - 2])
                points.append((n * group.row_bytes, steps[-1] - usual))
    finally:
        _stop_load(group, outputs, rids)
    return points


def _fit_link(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(bytes/s, s) of latency + bytes / bandwidth fitted to the median of the (bytes,
    seconds) points at each size (one slow point in a few does not move it)."""
    import numpy as np

    by_size: dict[float, list[float]] = {}
    for x, y in points:
        by_size.setdefault(x, []).append(y)
    if len(by_size) < 2:
        raise SystemExit(f"a latency and a bandwidth need two sizes, got {points}")
    xs = sorted(by_size)
    ys = [statistics.median(by_size[x]) for x in xs]
    slope, intercept = np.polyfit(np.array(xs), np.array(ys), 1)
    return (1.0 / slope if slope > 0 else 1e15), max(float(intercept), 0.0)


HANDOFF_PROMPTS = (64, 320, 800)


def _measure_handoff(
    group, outputs, decode_cost, worker_pb2, SamplingParams, receive=lambda rows: 0.0, whole=None
) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(bandwidth bytes/s, latency s) of what a request spends outside compute before its first
    token, on the idle group: TTFT less the member's prefill, the first decode step and the
    receive (``receive(rows)``: priced in the step that lands it), three requests per prompt
    length, fitted as latency + KV bytes / bandwidth. ``whole`` (a list) gets the same fitted
    with the receive left in, the hand-off as it was priced before the receive was measured."""
    from gearshift.operator.sim.tetris_sim import RECEIVE_STEP_S

    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    xs, ys, rs = [], [], []
    for n in HANDOFF_PROMPTS:
        for k in range(3):
            rid = f"handoff{n}.{k}"
            before = group.stats()["prefill_seconds_sum"]
            wire = worker_pb2.TetrisPlan(decode_instance=0)
            wire.chunks.add(num_tokens=n, prefill_instances=[0])
            t0 = time.perf_counter()
            group.submit(rid, [(5 * k + i) % 1000 for i in range(n)], params, wire)
            first = _token_times(outputs, [rid], 60)[rid][0] - t0
            prefill = group.stats()["prefill_seconds_sum"] - before
            step = decode_cost.step_time(decode_batch(1, n))
            xs.append(n * group.row_bytes)
            rs.append(receive(n))
            ys.append(first - prefill - step - RECEIVE_STEP_S - rs[-1])
    if whole is not None:
        whole.append(_fit_link([(x, y + r) for x, y, r in zip(xs, ys, rs, strict=True)]))
    return _fit_link(list(zip(xs, ys, strict=True)))


DECODE_BATCHES = (1, 2, 4, 8)
DECODE_PROMPT, DECODE_OUTPUT = 16, 41
DECODE_REPEATS = 3  # batches of each size, for the decode instance's per-step extra


def _measure_decode_steps(  # type: ignore[no-untyped-def]
    group, outputs, decode_cost, worker_pb2, SamplingParams
) -> tuple[tuple[int, float], ...]:
    """What the decode instance adds to each step over the one-rank profile, by batch size:
    ``n`` requests decoded together on the idle group, the median step less the profiled step
    at their mean context; the median of ``DECODE_REPEATS`` such batches (single batches of 2
    gave 1.5 and 5.7 ms in two runs)."""
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_OUTPUT, ignore_eos=True)
    points = []
    for n in DECODE_BATCHES:
        own = decode_cost.step_time(decode_batch(n, DECODE_PROMPT + DECODE_OUTPUT // 2))
        extras = []
        for repeat in range(DECODE_REPEATS):
            rids = [f"dec{n}.{repeat}.{i}" for i in range(n)]
            for i, rid in enumerate(rids):
                wire = worker_pb2.TetrisPlan(decode_instance=0)
                wire.chunks.add(num_tokens=DECODE_PROMPT, prefill_instances=[i % 2])
                ids = [(7 * i + 3 * repeat + k) % 1000 for k in range(DECODE_PROMPT)]
                group.submit(rid, ids, params, wire)
            times = _token_times(outputs, rids, 120)
            # Steps once every request of the batch decodes: from the last first token on.
            start = max(ts[0] for ts in times.values())
            steps = [
                b - a for ts in times.values() for a, b in itertools.pairwise(ts) if a >= start
            ]
            extras.append(statistics.median(steps) - own)
        points.append((n, max(statistics.median(extras), 0.0)))
    return tuple(points)


BUSY_LOAD = 8  # requests the decode instance decodes while the pool is profiled beside it


BESIDE_REPEATS = 5  # both instances at once, per length


def _measure_beside(
    group, outputs, worker_pb2, SamplingParams, alone
) -> list[tuple[str, int, int, float, float, float]]:  # type: ignore[no-untyped-def]
    """SP 1 chunks beside another rank against ``alone`` (the idle group's profile samples):
    on the first instance while the decode instance decodes ``BUSY_LOAD`` requests, and on
    both instances at once (each one's own time; ``probes._probe`` from a thread per
    instance). (beside what, history, length, median alone, median beside, their ratio) for
    each point."""
    from gearshift.worker.launch.tetris.probes import _probe

    rids = _start_load(group, outputs, worker_pb2, SamplingParams, "beside")
    try:
        decode = group.profile([1], PROFILE_HISTORIES, PROFILE_LENGTHS, PROFILE_REPEATS)
    finally:
        _stop_load(group, outputs, rids)
    seeds = itertools.count(10_000)
    pool: list[tuple[int, int, int, float]] = []
    for n in PROFILE_LENGTHS:
        for _ in range(BESIDE_REPEATS):
            got: list[float] = []

            def probe(member: int, length: int, seed: int, into: list[float] = got) -> None:
                into.append(_probe(group, [member], 0, length, seed))

            threads = [threading.Thread(target=probe, args=(m, n, next(seeds))) for m in (0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            if len(got) != 2:
                raise SystemExit(f"both instances at once, {n} tokens: {len(got)} of 2 answered")
            pool += [(1, 0, n, seconds) for seconds in got]

    def medians(samples: list[Any]) -> dict[tuple[int, int], float]:
        by: dict[tuple[int, int], list[float]] = {}
        for sp, c, n, seconds in samples:
            if sp == 1:
                by.setdefault((c, n), []).append(seconds)
        return {k: statistics.median(v) for k, v in by.items()}

    a = medians(alone)
    out = []
    for kind, samples in (("decode", decode), ("pool", pool)):
        b = medians(samples)
        out += [(kind, c, n, a[c, n], b[c, n], b[c, n] / a[c, n]) for c, n in sorted(b)]
    return out


def _profile_beside_decode(group, outputs, worker_pb2, SamplingParams) -> list[Any]:  # type: ignore[no-untyped-def]
    """The pool's profile grid while the decode instance decodes ``BUSY_LOAD`` requests (short
    prompts, long outputs, aborted once the profile is done)."""
    rids = _start_load(group, outputs, worker_pb2, SamplingParams, "load")
    try:
        return group.profile([], PROFILE_HISTORIES, PROFILE_LENGTHS, PROFILE_REPEATS)
    finally:
        _stop_load(group, outputs, rids)


def _start_load(group, outputs, worker_pb2, SamplingParams, prefix: str) -> list[str]:  # type: ignore[no-untyped-def]
    """``BUSY_LOAD`` requests (short prompts, long outputs) decoding on the decode instance;
    returns once every one has its first token."""
    params = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)
    rids = [f"{prefix}{i}" for i in range(BUSY_LOAD)]
    for i, rid in enumerate(rids):
        wire = worker_pb2.TetrisPlan(decode_instance=0)
        wire.chunks.add(num_tokens=16, prefill_instances=[i % 2])
        group.submit(rid, [(3 * i + k) % 1000 for k in range(16)], params, wire)
    _token_times(outputs, rids, 60, started=True)
    return rids


def _stop_load(group, outputs, rids: list[str]) -> None:  # type: ignore[no-untyped-def]
    """Abort ``_start_load``'s requests and drop their outputs; an aborted request still
    decoding would load what is measured next."""
    for rid in rids:
        group.abort(rid)
    time.sleep(0.5)
    while not outputs.empty():
        outputs.get_nowait()
    time.sleep(0.3)
    if not outputs.empty():
        raise SystemExit(f"{outputs.get_nowait()[0]} still ran after its abort")


def _run(group, trace, plans, outputs, worker_pb2, SamplingParams, times=False):  # type: ignore[no-untyped-def]
    """Replay ``trace`` in real time through the group with ``plans``; the measured figures
    (with ``times``: each request's first and last token times and token count)."""
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
    if times:
        return first, last, count
    return measured_figures(trace, first, last, count)


if __name__ == "__main__":
    main()
