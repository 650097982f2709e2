"""Ranks that share a host's CPU cores, in simulated time (processor sharing).

On GPUs every rank has a device of its own and a step takes what the cost model says. Ranks that
run on CPU cores of one host (the CPU build, ``gearshift serve`` on a small machine) do not: when
more ranks compute at once than the host has cores, the kernel's scheduler gives each a fair share,
so each runs at ``cores / busy ranks`` of its speed, and everything it computes takes that much
longer. A Tetris group of two prefill instances and one decode instance on two cores is such a
case: a ring prefill over both instances runs at 2/3 speed while the decode instance decodes.

A task is work measured in seconds at full speed, run by ``ranks`` ranks in lock step (a ring
chunk over its group, a TP step); every running task advances at the common rate
``min(1, cores / Σ ranks)``, re-computed whenever a task starts or ends.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from gearshift.operator.sim.events import EventLoop

# Work left below this (seconds) is done: what float rounding leaves of a finished task.
_DONE_S = 1e-9


@dataclass
class _Task:
    left: float  # seconds of work at full speed
    ranks: int
    then: Callable[[], None]
    order: int


class SharedCores:
    """Tasks on ``cores`` shared cores of one host, driven by ``loop``."""

    def __init__(self, loop: EventLoop, cores: int) -> None:
        if cores < 1:
            raise ValueError(f"cores must be >= 1, got {cores}")
        self.loop = loop
        self.cores = cores
        self._tasks: list[_Task] = []
        self._at = 0.0  # when the tasks' ``left`` was last brought up to date
        self._epoch = 0  # the scheduled wake-up that is still current
        self._order = itertools.count()
        self.busy_ranks_seconds = 0.0  # ∫ busy ranks dt (for the mean load)

    def rate(self) -> float:
        """Each running task's speed now, as a fraction of full speed."""
        busy = sum(t.ranks for t in self._tasks)
        return min(1.0, self.cores / busy) if busy else 1.0

    def run(self, seconds: float, ranks: int, then: Callable[[], None]) -> None:
        """Start ``seconds`` of full-speed work on ``ranks`` ranks now; ``then`` at its end."""
        if seconds < 0 or ranks < 1:
            raise ValueError(f"a task needs seconds >= 0 and ranks >= 1, got {seconds}, {ranks}")
        self._advance()
        self._tasks.append(_Task(seconds, ranks, then, next(self._order)))
        self._schedule()

    def _advance(self) -> None:
        now = self.loop.now
        dt = now - self._at
        if dt > 0 and self._tasks:
            rate = self.rate()
            self.busy_ranks_seconds += dt * sum(t.ranks for t in self._tasks)
            for t in self._tasks:
                t.left -= dt * rate
        self._at = now

    def _schedule(self) -> None:
        self._epoch += 1
        if not self._tasks:
            return
        first = min(self._tasks, key=lambda t: (t.left, t.order))
        due = self.loop.now + max(first.left, 0.0) / self.rate()
        self.loop.at(due, functools.partial(self._wake, self._epoch, first))

    def _wake(self, epoch: int, first: _Task) -> None:
        if epoch != self._epoch:
            return  # a task started or ended since: a newer wake-up is scheduled
        self._advance()
        done = [t for t in self._tasks if t is first or t.left <= _DONE_S]
        self._tasks = [t for t in self._tasks if not (t is first or t.left <= _DONE_S)]
        self._schedule()
        for t in sorted(done, key=lambda t: t.order):
            t.then()
