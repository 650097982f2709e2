"""Drive a multi-rank group: the leader sends each plan and runs its shard; followers loop.

With pipeline stages the leader (first stage) returns from ``submit`` once its own layers ran and
their activations are on their way; ``result`` then receives the step's logits from the last
stage. Followers of a pipeline take plans off the control channel on a thread of their own, so
the leader's next broadcast never waits for a stage that is still busy with the previous
micro-batch.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gearshift.worker.comm import CommGroup
from gearshift.worker.engine.control import (
    COLLECTIVES,
    KEEPALIVE,
    SHUTDOWN,
    STEP,
    ControlChannel,
)
from gearshift.worker.engine.model_runner import Done, ModelRunner, StepHandle
from gearshift.worker.engine.plan import StepPlan
from gearshift.worker.errors import GroupFailure
from gearshift.worker.p2p import P2P
from gearshift.worker.parallel.collective_timing import (
    CollectiveRequest,
    Points,
    time_collectives,
)
from gearshift.worker.parallel.pipeline import recv_logits
from gearshift.worker.parallel.watchdog import Watchdog
from gearshift.worker.step_phases import StepPhases

log = logging.getLogger(__name__)


def _first_line(exc: BaseException) -> str:
    # gloo's messages carry a source path and advice; the first line says what happened.
    return str(exc).splitlines()[0][-200:] if str(exc) else type(exc).__name__


def close_group(watchdog: Watchdog, channel: ControlChannel) -> None:
    """Orderly end on every rank: stop heartbeats, meet once more, tear the groups down."""
    watchdog.stop()
    try:
        dist.barrier(group=channel.group.group)
    finally:
        dist.destroy_process_group()


class _RemoteLogits:
    """A pipelined step whose logits the last stage sends to the leader."""

    def __init__(self, executor: GroupExecutor, plan: StepPlan) -> None:
        self.executor = executor
        self.rows = int(plan.logits_indices.shape[0])

    def result(self) -> torch.Tensor:
        ex = self.executor
        model = ex.runner.gears[0].model
        dtype = next(model.parameters()).dtype
        vocab = model.config.vocab_size
        if self.rows == 0:
            return torch.empty((0, vocab), dtype=dtype, device=ex.runner.device)
        channel = ex.logits_channel
        assert channel is not None, "a pipelined leader has the logits channel"
        return ex.guard(
            lambda: recv_logits(channel, ex.logits_rank, self.rows, vocab, dtype, ex.runner.device)
        )


class GroupExecutor:
    """The leader's executor: broadcast the plan, then run the leader's own shard."""

    def __init__(
        self,
        runner: ModelRunner,
        channel: ControlChannel,
        watchdog: Watchdog,
        children: Sequence[Any] = (),
        store: Any = None,
        on_shutdown: Callable[[], None] | None = None,
        logits_rank: int = 0,
        logits_channel: P2P | None = None,
        stop_children: Callable[[list[Any]], None] | None = None,
    ) -> None:
        self.runner = runner
        self.channel = channel
        self.watchdog = watchdog
        self.children = list(children)  # this host's follower processes
        self.store = store  # the rendezvous store this leader hosts: it lives as long as the group
        self.failure: str | None = None
        self._closed = False
        self._on_shutdown = on_shutdown  # undoes what the leader changed in its own process
        self.logits_rank = logits_rank  # where the logits appear (a pipeline's last stage)
        self.logits_channel = logits_channel
        self._stop_children = stop_children
        self.phases: StepPhases | None = None  # the engine's: the broadcast is added there

    def guard(self, fn: Callable[[], Any]) -> Any:
        """Run a step's communication; a failed collective becomes a GroupFailure naming the
        rank that is gone."""
        if self.failure is not None:
            raise GroupFailure(self.failure)
        try:
            return fn()
        except RuntimeError as exc:
            self.failure = f"worker group failed: {self.watchdog.diagnose()} ({_first_line(exc)})"
            raise GroupFailure(self.failure) from exc
        except (KeyboardInterrupt, SystemExit):
            # Interrupted (Ctrl-C, SIGTERM) in the middle of the step: its ranks may wait in
            # one of its collectives for good, and would never take a goodbye (shutdown kills).
            self.failure = "the leader was interrupted in the middle of a step"
            raise

    def submit(self, plan: StepPlan) -> StepHandle:
        def run() -> torch.Tensor | None:
            start = time.perf_counter()
            self.channel.send(STEP, plan)
            if self.phases is not None:
                self.phases.add("broadcast", time.perf_counter() - start)
            return self.runner.execute(plan)

        logits = self.guard(run)
        if logits is not None:
            return Done(logits)
        return _RemoteLogits(self, plan)

    def keepalive(self) -> None:
        if self.failure is None:
            self.channel.keepalive()

    def time_collectives(self, request: CollectiveRequest) -> dict[str, Points]:
        """Time ``request``'s collectives on every rank of the group (an idle group: no step in
        flight); each one's [[bytes, seconds], ...], the slowest rank's."""
        self.runner.flush()

        def run() -> dict[str, Points]:
            self.channel.send(COLLECTIVES, request)
            return time_collectives(request, world_group(), self.runner.device)

        result: dict[str, Points] = self.guard(run)
        return result

    def shutdown(self) -> None:
        """Stop every rank: an orderly goodbye if the group is healthy, kills if it is not."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.failure is None:
                try:
                    self.runner.flush()
                    self.channel.send(SHUTDOWN)
                    self.runner.shutdown()
                    close_group(self.watchdog, self.channel)
                except KeyboardInterrupt:  # interrupted in the goodbye: ranks may wait in it
                    for proc in self.children:
                        proc.kill()
                    raise
            else:
                self.runner.shutdown()
                self.watchdog.stop()
                for proc in self.children:
                    proc.kill()
        finally:
            if self._stop_children is not None:
                self._stop_children(self.children)
            self.store = None
            if self._on_shutdown is not None:
                self._on_shutdown()


def world_group() -> CommGroup:
    """The default process group (the layout's whole group) as a ``CommGroup``."""
    size = dist.get_world_size()
    return CommGroup(size, dist.get_rank(), tuple(range(size)))


def _pipelined(runner: ModelRunner) -> bool:
    return any(g.stage is not None for g in runner.gears)


def _receive_into(channel: ControlChannel, inbox: queue.Queue[Any]) -> None:
    try:
        while True:
            kind, plan = channel.recv()
            inbox.put((kind, plan, None))
            if kind == SHUTDOWN:
                return
    except BaseException as exc:  # noqa: BLE001 - handed to the compute loop, which reports it
        inbox.put((None, None, exc))


def follow(runner: ModelRunner, channel: ControlChannel, watchdog: Watchdog) -> None:
    """A follower rank's life: run every plan the leader sends until it says stop."""
    inbox: queue.Queue[Any] | None = None
    if _pipelined(runner):
        inbox = queue.Queue()
        threading.Thread(
            target=_receive_into, args=(channel, inbox), name="plan-receiver", daemon=True
        ).start()
    while True:
        try:
            if inbox is None:
                kind, plan = channel.recv()
            else:
                kind, plan, exc = inbox.get()
                if exc is not None:
                    raise exc
            if kind == SHUTDOWN:
                break
            if kind == KEEPALIVE or plan is None:
                continue
            if isinstance(plan, CollectiveRequest):
                runner.flush()  # a pipeline stage's sends of the last step are out first
                time_collectives(plan, world_group(), runner.device)
                continue
            assert kind == STEP
            runner.execute(plan)
        except RuntimeError as exc:
            message = watchdog.diagnose()
            watchdog.record_exit(f"collective failed after {message}")
            raise GroupFailure(f"rank {watchdog.rank}: {message} ({_first_line(exc)})") from exc
    runner.flush()
    runner.shutdown()
    close_group(watchdog, channel)
