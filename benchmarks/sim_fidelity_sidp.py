"""SiDP's simulation against a real SiDP group on this machine (issue 16, "each new policy once
it exists"): the same trace through a running group (dp 2 replicas of one rank each, gloo, WaS
pinned) and through the simulator, predicted vs measured.

The simulator's inputs are measured here first, on the same model and settings:

* a replica's step without weight fetches: ``gearshift profile``'s measurement of a one-rank
  engine without the fused decode-layer op (a SiDP replica computes every layer, as that engine
  does, but its FFN modules are the policy's, which the fused op cannot run), taken while a second
  one-rank engine decodes in another process, as the other replica does when the group runs
  (``--no-neighbour``: alone);
* one remote FFN layer's fetch: the housekeeper's copy of a layer from a shared-memory segment
  into a cache slot, timed on one thread (a replica's rank has one core and one torch thread);
* the replica's KV capacity: the block count each started replica reports (SiDP gives the KV
  cache the FFN bytes a replica does not hold).

A step is priced as compute plus its pass's fetches (``sidp_cost.MeasuredWasCost`` without
overlap: here the housekeeper thread shares its replica's core). Requests are assigned to
replicas by the router's rule (fewest outstanding tokens, as they arrive), the same assignment on
both sides; WaS replicas run independently (§4.2), so the simulator runs each replica on its own
share of the trace. Both sides are warm: the profiled engine from its grid, the group from a
short warm-up trace of its own before the measured one.

With ``--mode CAS`` the replicas step together (§4.3), and the simulator runs them as one group
(``operator/sim/lockstep.py``): a step costs the slowest replica's own step (the same profile;
when only one replica has work, a second profile taken with no neighbour, since on two shared
cores a replica whose neighbour idles runs faster) plus what each layer's activation exchange
adds, which is measured on the running group before the trace (``exchange_points``: decode
batches and single prompts, on both replicas and on one), as ``sidp_cost.MeasuredCasCost``
prices it.

    python benchmarks/sim_fidelity_sidp.py              # → sim_fidelity_sidp.json, ~1 min
    python benchmarks/sim_fidelity_sidp.py --rate 6 --requests 48 --out ...online.json
    python benchmarks/sim_fidelity_sidp.py --mode CAS --out sim_fidelity_sidp_cas.json
    python benchmarks/sim_fidelity_sidp.py --oos        # out of sample (benchmarks/fidelity_oos.py)
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from multiprocessing.connection import wait
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
    fidelity_trace,
    measured_figures,
    profile_grid,
    random_llama,
)

DP = 2


def _neighbour(config: Any, ready: Any, stop: Any) -> None:
    """Another replica's load while the profile runs: a one-rank engine decoding batches of 16
    requests until told to stop."""
    from gearshift.worker.launch import start_engine
    from gearshift.worker.sampling.params import SamplingParams

    engine = start_engine(config)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    n = 0
    ready.set()
    while not stop.is_set():
        if not engine.has_unfinished_requests():
            for _ in range(16):
                engine.add_request(f"n{n}", [(5 * n + k) % 1000 for k in range(120)], params)
                n += 1
        engine.step()
    engine.shutdown()


def profile_beside_neighbour(config: Any, grid: Any, seed: int, neighbour: bool) -> Any:
    import multiprocessing as mp

    from gearshift.operator.sim.profile import measure
    from gearshift.worker.launch import start_engine

    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_neighbour, args=(config, ready, stop)) if neighbour else None
    engine = start_engine(config)
    # A SiDP replica's FFN modules are the policy's (SidpFFN), which the fused decode-layer CPU
    # op cannot run (llama.prepare_fused_decode): profile the unfused path the replica takes.
    for gear in engine.executor.gears:
        gear.model.fused_layers = []
    try:
        if proc is not None:
            proc.start()
            if not ready.wait(120):
                raise RuntimeError("the neighbour engine did not start in 120 s")
        return measure(engine, grid, seed).model({"model": "random-llama"})
    finally:
        stop.set()
        if proc is not None:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
        engine.shutdown()


def fetch_seconds(config: Any, repeats: int = 30) -> tuple[float, int]:
    """Median time of one remote FFN layer's copy from a shared segment into a slot (one
    thread), and the layer's bytes."""
    import torch

    from gearshift.worker import shm_segments
    from gearshift.worker.engine.loading import inspect_model
    from gearshift.worker.policies.sidp.shared_weights import FfnLayout, Segment, new_segment_name

    spec, source = inspect_model(config, torch.device("cpu"))
    source.close()
    layout = FfnLayout.of(spec.config)
    nbytes = layout.numel * spec.dtype.itemsize
    seg = Segment(new_segment_name(shm_segments.group_key(), 0), nbytes, create=True)
    try:
        src = seg.tensor(spec.dtype)
        src.normal_()
        slot = torch.empty(layout.numel, dtype=spec.dtype)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            slot.copy_(src)
            times.append(time.perf_counter() - t)
        torch.set_num_threads(threads)
        return statistics.median(times), nbytes
    finally:
        seg.close()


EXCHANGE_BATCHES = (1, 4, 16, 32)  # decode sequences per busy replica
EXCHANGE_PROMPT, EXCHANGE_OUTPUT = 32, 41
EXCHANGE_PREFILLS = (128, 512)  # one prompt's tokens per busy replica (one step each)


def _prefill_batch(n: int) -> Any:
    from gearshift.worker.engine.scheduler import ScheduledBatch
    from gearshift.worker.engine.sequence import Sequence

    batch = ScheduledBatch()
    seq = Sequence("p", [0] * n, params=None, max_tokens=1)  # type: ignore[arg-type]
    batch.prefills.append((seq, n))
    return batch


def exchange_points(
    group: Any,
    base: Any,
    layers: int,
    idle_poll_s: float,
    prefills: tuple[int, ...] = EXCHANGE_PREFILLS,
    alone: Any = None,
    served_by_base: list[tuple[int, float]] | None = None,
) -> tuple[Any, Any]:
    """What a CaS layer's exchange adds to a step, measured on the running group (CaS pinned),
    with work on both replicas (``shared``: the owner computes too) and on replica 0 alone
    (``served``: the owner runs a dummy step): a step's time less replica 0's own step
    (``base``), per exchanging layer, by the group's rows. Decode steps: batches of n sequences
    (the step is the decode TPOT); prefill steps: one prompt per busy replica, in one step (the
    median TTFT of three tries, less the mean wait of an idle group, ``idle_poll_s`` / 2).
    ``alone``: replica 0's own step with its neighbour idle, which the ``served`` points are
    measured against (None: ``base``); ``served_by_base`` (a list) also gets the same steps'
    points measured against ``base``, for a pricing without ``alone``."""
    from gearshift.operator.sim.trace import TraceRequest
    from gearshift.worker.policies.sidp.ownership import Ownership

    remote = layers - len(Ownership(DP, layers).owned(0))
    context = EXCHANGE_PROMPT + EXCHANGE_OUTPUT // 2  # the mean context of the decode steps
    shared: list[tuple[int, float]] = []
    served: list[tuple[int, float]] = []

    def add(busy: int, rows: int, step: float, batch: Any) -> None:
        if busy == DP:  # every layer exchanges, its owner busy too
            shared.append((DP * rows, max((step - base.step_time(batch)) / layers, 0.0)))
        else:  # replica 0's remote layers exchange, with an idle owner
            own = (alone or base).step_time(batch)
            served.append((rows, max((step - own) / remote, 0.0)))
            if served_by_base is not None:
                served_by_base.append((rows, max((step - base.step_time(batch)) / remote, 0.0)))

    for n in EXCHANGE_BATCHES:
        for busy in (DP, 1):
            trace = [TraceRequest(0.0, EXCHANGE_PROMPT, EXCHANGE_OUTPUT)] * (n * busy)
            picks = [i % busy for i in range(len(trace))]
            step = run_group(group, trace, picks, prefix=f"x{n}.{busy}.")["tpot_mean_s"]
            add(busy, n, step, decode_batch(n, context))
    for n in prefills:
        for busy in (DP, 1):
            trace = [TraceRequest(0.0, n, 2)] * busy
            tries = [
                run_group(group, trace, list(range(busy)), prefix=f"p{n}.{busy}.{k}.")
                for k in range(3)
            ]
            step = statistics.median(t["ttft_mean_s"] for t in tries) - idle_poll_s / 2
            add(busy, n, step, _prefill_batch(n))
    return tuple(sorted(shared)), tuple(sorted(served))


def run_group(
    group: Any, trace: list[Any], picks: list[int], prefix: str = "r"
) -> dict[str, float]:
    """Replay ``trace`` on the group's replicas (request i on replica picks[i]) in real time,
    timing each streamed token batch as it arrives here."""
    return measured_figures(trace, *group_times(group, trace, picks, prefix))


def group_times(group: Any, trace: list[Any], picks: list[int], prefix: str = "r") -> Any:
    """``run_group``'s replay: each request's first and last token times and token count, by
    request id ``r{index}``."""
    from gearshift.worker.launch import replica_messages as rm
    from gearshift.worker.sampling.params import SamplingParams

    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count: dict[str, int] = {}
    finished: set[str] = set()
    pending = list(enumerate(trace))
    start = time.perf_counter()
    deadline = start + 600
    while pending or len(finished) < len(trace):
        if time.perf_counter() > deadline:
            raise RuntimeError("the group did not finish the trace in 600 s")
        now = time.perf_counter() - start
        while pending and pending[0][1].arrival_s <= now:
            i, r = pending.pop(0)
            ids = [(7 * i + k) % 1000 for k in range(r.prompt_tokens)]
            params = SamplingParams(temperature=0.0, max_tokens=r.output_tokens, ignore_eos=True)
            group.send(picks[i], rm.AddRequest(f"{prefix}{i}", ids, params))
        # Block until a replica sends something or the next arrival is due: a polling loop
        # would take CPU from the two replicas on this 2-core machine.
        due = pending[0][1].arrival_s - (time.perf_counter() - start) if pending else 1.0
        for conn in wait(group.conns, timeout=max(0.0, min(due, 1.0))):
            while conn.poll(0):
                match got := rm.FROM_REPLICA.recv(conn):
                    case rm.Output():
                        out = got.output
                    case rm.Refused():
                        raise RuntimeError(f"replica refused {got.request_id}: {got.error}")
                    case _:
                        raise RuntimeError(f"unexpected {type(got).__name__} from a replica")
                t = time.perf_counter() - start
                if out.new_token_ids:
                    first.setdefault(out.request_id, t)
                    last[out.request_id] = t
                    count[out.request_id] = count.get(out.request_id, 0) + len(out.new_token_ids)
                if out.finished:
                    finished.add(out.request_id)
    if prefix != "r":  # measured_figures names requests r{i}
        rename = {f"{prefix}{i}": f"r{i}" for i in range(len(trace))}
        first, last = ({rename[k]: v for k, v in d.items()} for d in (first, last))
        count = {rename[k]: v for k, v in count.items()}
    return first, last, count


def simulate_group(config, base, shared_served, blocks, trace, picks, mode, layers):  # type: ignore[no-untyped-def]
    """The group in the simulator, on the same assignment: each request's simulated times, in
    trace order (WaS: each replica alone on its share; CaS: the replicas in lock step)."""
    from gearshift.operator.sim.lockstep import simulate_lockstep
    from gearshift.operator.sim.replica import ReplicaConfig
    from gearshift.operator.sim.sidp_cost import MeasuredCasCost, MeasuredWasCost
    from gearshift.operator.sim.simulator import Deployment, simulate
    from gearshift.worker.launch.replica_rank import IDLE_WAIT_S
    from gearshift.worker.policies.sidp.ownership import Ownership

    def replica(num_blocks: int) -> ReplicaConfig:
        return ReplicaConfig(
            num_blocks=num_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
        )

    if mode == "CAS":
        # CaS replicas step together (§4.3): the group is simulated as one, each replica
        # with its own scheduler and the fewer of the two replicas' KV blocks.
        cas_cost = MeasuredCasCost(base, layers, DP, *shared_served)
        return simulate_lockstep(
            DP, replica(min(blocks)), cas_cost, trace, picks, idle_poll_s=IDLE_WAIT_S
        ).requests
    fetch_s = shared_served[0]
    remote = layers - len(Ownership(DP, layers).owned(0))
    cost = MeasuredWasCost(base, remote, fetch_s, overlap=False)
    times: list[Any] = [None] * len(trace)
    for r in range(DP):
        # Each replica alone on its share (WaS replicas are independent, §4.2): both sides
        # run the same assignment, online too.
        mine = [i for i, pick in enumerate(picks) if pick == r]
        got = simulate(Deployment(1, replica(blocks[r]), cost), [trace[i] for i in mine])
        for i, t in zip(mine, got.requests, strict=True):
            times[i] = t
    return times


def combined(times: list[Any]) -> dict[str, float]:
    """The group's figures from every replica's simulated requests (``simulated``'s)."""
    span = max(t.finished for t in times) - min(t.arrival for t in times)
    tpot = [v for t in times if (v := t.tpot) is not None]
    return {
        "makespan_s": span,
        "output_tokens_per_s": sum(t.output_tokens for t in times) / span,
        "ttft_mean_s": statistics.mean(t.ttft for t in times),
        "tpot_mean_s": statistics.mean(tpot),
    }


def out_of_sample(args, group, config, base, inputs, blocks, one_profile=None) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """Every validation trace through the warm group and the simulator, each assigned by the
    router's rule up front (the same assignment on both sides); ``one_profile``: CaS inputs
    priced without the alone profile, simulated beside (``one_profile`` in the report)."""
    from gearshift.operator.sim.routing import LeastOutstandingRouter

    oos = fidelity_oos()
    picked: dict[int, list[int]] = {}

    def picks(trace: list[Any]) -> list[int]:
        router = LeastOutstandingRouter(DP)
        out = [router.pick(f"r{i}", r.prompt_tokens, r.output_tokens) for i, r in enumerate(trace)]
        picked[id(trace)] = out
        return out

    def measure(trace: list[Any]) -> Any:
        return oos.engine_records(trace, *group_times(group, trace, picks(trace)))

    def simulate(trace: list[Any], priced: Any = inputs) -> Any:
        times = simulate_group(
            config, base, priced, blocks, trace, picked[id(trace)], args.mode, args.layers
        )
        return oos.time_records(times)

    alternatives = {}
    if one_profile is not None:  # CaS priced by one profile, as before the alone profile
        alternatives["one_profile"] = functools.partial(simulate, priced=one_profile)
    return oos.run(
        oos.scenarios(args.oos_lengths, args.oos_arrivals, args.oos_seeds),
        args.oos_requests,
        args.oos_rate,
        measure,
        simulate,
        alternatives,
    )


def _step_json(cost: Any) -> dict[str, Any]:
    return {
        "prefill": vars(cost.prefill),
        "decode": vars(cost.decode),
        "decode_scale": cost.decode_scale,
    }


def main() -> None:
    from gearshift.operator.sim.routing import LeastOutstandingRouter
    from gearshift.operator.sim.trace import TraceRequest
    from gearshift.worker.launch import GroupConfig
    from gearshift.worker.launch.replica_rank import IDLE_WAIT_S
    from gearshift.worker.launch.replicas import start_replicas
    from gearshift.worker.policies.registry import make_policy
    from gearshift.worker.policies.sidp.ownership import Ownership

    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rate", type=float, default=0.0, help="Poisson req/s; 0: offline")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-neighbour", dest="neighbour", action="store_false")
    ap.add_argument("--mode", choices=("WAS", "CAS"), default="WAS", help="the SiDP mode, pinned")
    ap.add_argument("--out", type=Path, default=None, help="default: sim_fidelity_sidp[_oos].json")
    add_oos_args(ap)
    args = ap.parse_args()
    if args.out is None:
        args.out = HERE / ("sim_fidelity_sidp_oos.json" if args.oos else "sim_fidelity_sidp.json")
    if args.cpu_clock:
        raise SystemExit("--cpu-clock times one rank: a SiDP group runs two")

    with tempfile.TemporaryDirectory() as tmp:
        model = str(random_llama(Path(tmp), hidden=args.hidden, layers=args.layers))
        config = engine_config(model, 1, kv_cache_bytes=32 << 20)
        t0 = time.perf_counter()
        base = profile_beside_neighbour(config, profile_grid(), args.seed, args.neighbour)
        cas = args.mode == "CAS"
        # CaS prices a step with one busy replica by its step alone (MeasuredCasCost.alone).
        alone = None
        if cas and args.neighbour:
            alone = profile_beside_neighbour(config, profile_grid(), args.seed, False)
        profile_s = time.perf_counter() - t0
        fetch_s, layer_bytes = fetch_seconds(config)
        remote = args.layers - len(Ownership(DP, args.layers).owned(0))
        by_base: list[tuple[int, float]] = []
        shared: Any = ()
        served: Any = ()

        trace = fidelity_trace(args.requests, args.rate, args.seed)
        # The router's rule (fewest outstanding tokens, as requests arrive), fixed up front.
        router = LeastOutstandingRouter(DP)
        picks = [
            router.pick(f"r{i}", r.prompt_tokens, r.output_tokens) for i, r in enumerate(trace)
        ]
        policy = make_policy({"sidp": {"dp": DP, "mode": args.mode}})
        group = start_replicas(config, policy, GroupConfig(timeout_s=120), stream=True)
        try:
            blocks = [int(r["num_blocks"]) for r in group.ready]
            # Warm both replicas as the profile warmed its engine (first steps of a fresh process
            # pay one-time setup), with a trace of its own.
            warm = [TraceRequest(0.0, n, 8) for n in (500, 320, 160, 64, 16, 300, 200, 100)]
            run_group(group, warm, [i % DP for i in range(len(warm))], prefix="w")
            if cas:
                t0 = time.perf_counter()
                shared, served = exchange_points(
                    group, base, args.layers, IDLE_WAIT_S, alone=alone, served_by_base=by_base
                )
                profile_s += time.perf_counter() - t0
            if args.oos:
                inputs = (shared, served, alone) if cas else (fetch_s, None)
                one_profile = None
                if cas and alone is not None:
                    one_profile = (shared, tuple(sorted(by_base)), None)
                report = out_of_sample(args, group, config, base, inputs, blocks, one_profile)
            else:
                measured = run_group(group, trace, picks)
            stats = [group.stats(r) for r in range(DP)]
        finally:
            group.shutdown()
        if args.oos:
            report = {
                "command": "python " + " ".join(sys.argv),
                "dp": DP,
                "mode": args.mode,
                "profile_s": profile_s,
                "cost_model": {
                    **_step_json(base),
                    "fetch_seconds_per_layer": fetch_s,
                    "cas_shared_exchange_by_rows": shared,
                    "cas_served_exchange_by_rows": served,
                    "alone": None if alone is None else _step_json(alone),
                },
                "kv_blocks": blocks,
                **report,
            }
            args.out.write_text(json.dumps(report, indent=2) + "\n")
            return
        t0 = time.perf_counter()
        inputs = (shared, served, alone) if cas else (fetch_s, None)
        times = simulate_group(config, base, inputs, blocks, trace, picks, args.mode, args.layers)
        sim_s = time.perf_counter() - t0
        predicted = combined(times)

    rows = compare(measured, predicted)
    fetched = sum(s["policy"]["sidp_fetched_weight_bytes"] for s in stats)
    steps = sum(s["engine"].steps for s in stats)
    waits = sum(s["policy"]["sidp_slot_waits"] for s in stats)
    print(
        f"profile {profile_s:.1f} s; one layer's fetch {fetch_s * 1e3:.3f} ms "
        f"({layer_bytes / 2**20:.1f} MiB); {remote} remote layers a pass; KV blocks {blocks}; "
        f"fetched {fetched / 2**20:.0f} MiB over {steps} steps, compute waited for a slot "
        f"{waits:.0f} times; simulation {sim_s * 1e3:.1f} ms"
    )
    result_json = {
        "command": "python " + " ".join(sys.argv),
        "dp": DP,
        "mode": args.mode,
        "profile_beside_a_neighbour": args.neighbour,
        "cost_model": {
            **_step_json(base),
            "fetch_seconds_per_layer": fetch_s,
            "layer_bytes": layer_bytes,
            "remote_layers": remote,
            "overlap": False,
            "cas_shared_exchange_by_rows": shared,
            "cas_served_exchange_by_rows": served,
            "alone": None if alone is None else _step_json(alone),
        },
        "kv_blocks": blocks,
        "group": {"steps": steps, "fetched_bytes": fetched, "slot_waits": waits},
        "rows": rows,
    }
    args.out.write_text(json.dumps(result_json, indent=2) + "\n")


if __name__ == "__main__":
    main()
