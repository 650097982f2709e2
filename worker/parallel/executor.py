"""Drive a multi-rank group: the leader sends each plan and runs its shard; followers loop."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gearshift.worker.engine.model_runner import ModelRunner
from gearshift.worker.engine.plan import StepPlan
from gearshift.worker.errors import GroupFailure
from gearshift.worker.parallel.control import KEEPALIVE, SHUTDOWN, STEP, ControlChannel
from gearshift.worker.parallel.watchdog import Watchdog

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
    ) -> None:
        self.runner = runner
        self.channel = channel
        self.watchdog = watchdog
        self.children = list(children)  # this host's follower processes
        self.store = store  # the rendezvous store this leader hosts: it lives as long as the group
        self.failure: str | None = None
        self._closed = False
        self._on_shutdown = on_shutdown  # undoes what the leader changed in its own process

    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        if self.failure is not None:
            raise GroupFailure(self.failure)
        try:
            self.channel.send(STEP, plan)
            return self.runner.execute(plan)
        except RuntimeError as exc:
            # A collective failed: find out which rank is gone before giving up on the group.
            self.failure = f"worker group failed: {self.watchdog.diagnose()} ({_first_line(exc)})"
            raise GroupFailure(self.failure) from exc

    def keepalive(self) -> None:
        if self.failure is None:
            self.channel.keepalive()

    def shutdown(self) -> None:
        """Stop every rank: an orderly goodbye if the group is healthy, kills if it is not."""
        from gearshift.worker.launch import stop_processes

        if self._closed:
            return
        self._closed = True
        self.runner.shutdown()
        try:
            if self.failure is None:
                self.channel.send(SHUTDOWN)
                close_group(self.watchdog, self.channel)
            else:
                self.watchdog.stop()
                for proc in self.children:
                    proc.kill()
        finally:
            stop_processes(self.children)
            self.store = None
            if self._on_shutdown is not None:
                self._on_shutdown()


def follow(runner: ModelRunner, channel: ControlChannel, watchdog: Watchdog) -> None:
    """A follower rank's life: run every plan the leader sends until it says stop."""
    while True:
        try:
            kind, plan = channel.recv()
            if kind == SHUTDOWN:
                break
            if kind == KEEPALIVE or plan is None:
                continue
            assert kind == STEP
            runner.execute(plan)
        except RuntimeError as exc:
            message = watchdog.diagnose()
            watchdog.record_exit(f"collective failed after {message}")
            raise GroupFailure(f"rank {watchdog.rank}: {message} ({_first_line(exc)})") from exc
    runner.shutdown()
    close_group(watchdog, channel)
