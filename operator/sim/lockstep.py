"""Replicas that step together, in simulated time: SiDP in CaS mode (§4.3).

In CaS every replica's step starts with one small all-gather (``worker/policies/sidp/
group_step.py``), so the replicas run their steps at the same time and each waits for the
slowest: the owner of a layer runs that layer's FFN over every replica's rows, the other replicas
wait for their slice. An idle replica still joins each step, running a dummy step that serves the
layers it owns. So unlike ``simulator.simulate``'s independent replicas, a group step here begins
for all replicas at once, lasts what ``GroupStepCost`` says for the batches of all of them, and
the next begins when it ends.

Each replica keeps its own scheduler and KV blocks (``replica.SimReplica``, the engine's
``Scheduler`` and ``BlockManager``), and requests go to a replica by the router's rule, or by a
fixed assignment (``picks``) when a run is compared with a real group that was given one.

When no replica has work, the replicas poll their pipes every ``idle_poll_s``; the first step
after an idle spell starts ``idle_poll_s / 2`` after the request that ends it (the mean wait for
the replica that was asleep), and the steps after it follow without a pause.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Protocol

from gearshift.operator.sim.events import EventLoop
from gearshift.operator.sim.replica import ReplicaConfig, RequestTimes, SimReplica
from gearshift.operator.sim.results import SimResult
from gearshift.operator.sim.routing import LeastOutstandingRouter
from gearshift.operator.sim.simulator import collect, refusal
from gearshift.operator.sim.trace import TraceRequest
from gearshift.worker.engine.scheduler import ScheduledBatch


class GroupStepCost(Protocol):
    """Seconds one group step takes, given each replica's batch (None: that replica is idle
    and runs a dummy step)."""

    def group_step_time(self, batches: Sequence[ScheduledBatch | None]) -> float: ...


class _Unpriced:
    """A replica's own step cost: none; the group step is priced as a whole."""

    def step_time(self, batch: ScheduledBatch) -> float:
        del batch
        return 0.0


def simulate_lockstep(
    replicas: int,
    config: ReplicaConfig,
    cost: GroupStepCost,
    trace: Sequence[TraceRequest],
    picks: Sequence[int] | None = None,
    idle_poll_s: float = 0.0,
) -> SimResult:
    """Every request of ``trace`` through ``replicas`` replicas that step together;
    deterministic. ``picks[i]``: request i's replica (default: the router's rule)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if picks is not None and (
        len(picks) != len(trace) or any(not 0 <= p < replicas for p in picks)
    ):
        raise ValueError(f"picks must give each of {len(trace)} requests a replica < {replicas}")
    if idle_poll_s < 0:
        raise ValueError(f"idle_poll_s must be >= 0, got {idle_poll_s}")
    loop = EventLoop()
    router = LeastOutstandingRouter(replicas) if picks is None else None
    reps = [SimReplica(i, config, _Unpriced()) for i in range(replicas)]
    done: list[RequestTimes] = []
    rejected: list[tuple[int, str]] = []
    waking = False  # a first step after an idle spell is scheduled

    def step() -> None:
        # Each replica schedules its own batch (an empty one: a dummy step), at the same time.
        nonlocal waking
        waking = False
        running = [rep for rep in reps if rep.launch(loop.now) is not None]
        if not running:
            return
        batches = [rep.in_flight[0].batch if rep.in_flight else None for rep in reps]
        seconds = cost.group_step_time(batches)
        for rep in running:
            rep.busy_s += seconds
        loop.at(loop.now + seconds, functools.partial(end, running))

    def end(running: list[SimReplica]) -> None:
        for rep in running:
            for rid, n, finished in rep.finish_step(loop.now):
                if router is not None:
                    router.on_tokens(rid, n, finished)
                if finished:
                    done.append(rep.times.pop(rid))
        step()

    def arrive(index: int, req: TraceRequest) -> None:
        nonlocal waking
        if (why := refusal(req, config.max_model_len)) is not None:
            rejected.append((index, why))
            return
        rid = f"r{index}"
        if router is not None:
            rep = reps[router.pick(rid, req.prompt_tokens, req.output_tokens)]
        else:
            assert picks is not None
            rep = reps[picks[index]]
        rep.add(rid, loop.now, req.prompt_tokens, req.output_tokens)
        if all(r.idle for r in reps) and not waking:
            # After every other event at this instant, so requests arriving together share
            # the first step, as they would in the engine's queue.
            waking = True
            loop.at(loop.now + idle_poll_s / 2, step)

    for i, req in enumerate(trace):
        loop.at(req.arrival_s, functools.partial(arrive, i, req))
    loop.run()
    return collect(reps, done, rejected)
