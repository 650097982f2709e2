"""Run a trace through one deployment: N replicas behind the router's rule, in simulated time.

Arrivals go to a replica by ``routing.py``'s rule; an idle replica starts a step at once; at the
end of a step its tokens go back to the router and the replica starts its next step. Requests
the engine would refuse (prompt plus output longer than the model's context) are reported as
rejected, with the reason, not dropped.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gearshift.operator.sim.cost_model import StepCost
from gearshift.operator.sim.events import EventLoop
from gearshift.operator.sim.model_desc import StageShares
from gearshift.operator.sim.replica import (
    ReplicaConfig,
    RequestTimes,
    SimHooks,
    SimReplica,
    StepAsk,
)
from gearshift.operator.sim.results import SimResult
from gearshift.operator.sim.routing import LeastOutstandingRouter
from gearshift.operator.sim.trace import TraceRequest


@dataclass(frozen=True)
class Deployment:
    """What is simulated: ``replicas`` identical worker groups of ``config``, priced by ``cost``."""

    replicas: int
    config: ReplicaConfig
    cost: StepCost
    step_request: StepAsk | None = None  # the policy's say before each step (default: ANY)
    micro_batches: int = 1  # steps in flight per replica (a pipeline's Policy.micro_batches())
    stages: int = 1  # pipeline stages a step's cost is spread over
    stage_shares: (
        tuple[float, ...] | StageShares
    ) = ()  # each stage's share (ModelDesc.stage_shares); (): equal
    # A policy that drives each step itself (a fresh one per replica; replica.SimHooks).
    hooks: Callable[[], SimHooks] | None = None

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")


def simulate(deployment: Deployment, trace: Sequence[TraceRequest]) -> SimResult:
    """Every request of ``trace`` from arrival to its last token; deterministic."""
    loop = EventLoop()
    router = LeastOutstandingRouter(deployment.replicas)
    replicas = [
        SimReplica(
            i,
            deployment.config,
            deployment.cost,
            deployment.step_request,
            deployment.micro_batches,
            deployment.stages,
            deployment.hooks() if deployment.hooks is not None else None,
            deployment.stage_shares,
        )
        for i in range(deployment.replicas)
    ]
    done: list[RequestTimes] = []
    rejected: list[tuple[int, str]] = []
    limit = deployment.config.max_model_len
    waking: set[int] = set()

    def start(rep: SimReplica) -> None:
        # Called when no event is pending for the replica (idle, or its oldest step just
        # ended): launch what fits and wait for the oldest in-flight step.
        done = rep.launch(loop.now)
        if done is not None:
            loop.at(done, lambda: end(rep))

    def end(rep: SimReplica) -> None:
        report: list[tuple[str, int, bool]] | None = rep.finish_step(loop.now)
        while report is not None:
            for rid, n, finished in report:
                router.on_tokens(rid, n, finished)
                if finished:
                    done.append(rep.times.pop(rid))
            # A plain decode step that ends before any other event runs here, at once: the
            # same step, the same times, without the event queue (SimReplica.decode_step).
            report = rep.decode_step(loop.now, loop.next_time())
            if report is not None:
                loop.advance(rep.clock)
        start(rep)

    def arrive(index: int, req: TraceRequest) -> None:
        if (why := refusal(req, limit)) is not None:
            rejected.append((index, why))
            return
        rid = f"r{index}"
        rep = replicas[router.pick(rid, req.prompt_tokens, req.output_tokens)]
        rep.add(rid, loop.now, req.prompt_tokens, req.output_tokens)
        if rep.idle and rep.index not in waking:
            # Start after every other event at this instant, so requests arriving together
            # share the first step as they would in the engine's queue.
            waking.add(rep.index)
            loop.at(loop.now, functools.partial(wake, rep))

    def wake(rep: SimReplica) -> None:
        waking.discard(rep.index)
        if rep.idle:
            start(rep)

    for i, req in enumerate(trace):
        loop.at(req.arrival_s, functools.partial(arrive, i, req))
    loop.run()
    return collect(replicas, done, rejected)


def refusal(req: TraceRequest, max_model_len: int) -> str | None:
    """Why the engine refuses ``req`` (LLMEngine._check_prompt: the router answers 400), or
    None: such requests are counted as rejected, not run."""
    if req.prompt_tokens + req.output_tokens > max_model_len:
        return f"{req.prompt_tokens} + {req.output_tokens} tokens exceed {max_model_len}"
    return None


def collect(
    replicas: Sequence[SimReplica], done: list[RequestTimes], rejected: list[tuple[int, str]]
) -> SimResult:
    """The run's result once its events are spent; a replica left with work means the
    scheduler could not place a request at all: its KV needs more blocks than exist."""
    leaked = [r.index for r in replicas if r.blocks.leaked_blocks() or r.scheduler.has_unfinished]
    if leaked:
        config = replicas[0].config
        raise RuntimeError(
            f"replicas {leaked} cannot run their requests: a request needs more KV blocks than "
            f"the replica has ({config.num_blocks} of {config.block_size})"
        )
    return SimResult.of(done, list(rejected), list(replicas))
