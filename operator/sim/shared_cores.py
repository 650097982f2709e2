"""Ranks that share a host's CPU cores, in simulated time.

On GPUs every rank has a device of its own and a step takes what the cost model says. Ranks that
run on CPU cores of one host (the CPU build, ``gearshift serve`` on a small machine) do not: what
one computes slows what another computes. Each running task gets a speed, re-computed whenever a
task starts or ends:

- **Processor sharing**: when more ranks compute at once than the host has cores,
  the kernel's scheduler gives each a fair share, so every task runs at ``min(1, cores / busy
  ranks)`` of its speed. A Tetris ring over two instances beside a decoding instance on two
  cores: 2/3.
- **Lock-step gangs** (``gangs``): the kernel schedules each rank on its own,
  so a task whose ranks work in lock step (a ring) advances only while all of them hold a core.
  Each holds one for a ``share`` of the time, independently, so the task runs at ``share **
  ranks``: a ring of two beside a decoding rank on two cores at (2/3)² ≈ 0.44, 2.25× slower.
  (``benchmarks/sim_fidelity_tetris.py`` profiles such a group's pool beside its decoding
  instance: its two-instance chunks ran 1.7–2.4× slower than alone in most profiles, 1.2× at
  the least.)

A task is work measured in seconds at full speed, run by ``ranks`` ranks in lock step (a ring
chunk over its group, a TP step).

- **Interference** (``beside``): ranks on cores of their own still share the host's caches,
  memory bandwidth and clock, so a task can run slower beside another than alone even with a core
  to itself. A task started with ``slowed`` runs at its speed over ``beside`` while another task
  runs on these cores, or while its owner says that something outside them computes
  (``set_outside_busy``: ``tetris_sim``'s decode rank pinned apart from the pool), by the factor
  ``benchmarks/sim_fidelity_tetris.py`` measures.
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
    slowed: bool = False  # runs at its speed over ``beside`` while in company


class SharedCores:
    """Tasks on one host's ``cores``, driven by ``loop``: processor-shared, and with ``gangs``
    each task's ranks in lock step."""

    def __init__(
        self, loop: EventLoop, cores: int, gangs: bool = False, beside: float = 1.0
    ) -> None:
        if cores < 1:
            raise ValueError(f"cores must be >= 1, got {cores}")
        if beside < 1.0:
            raise ValueError(f"beside must be >= 1, got {beside}")
        self.beside = beside
        self.loop = loop
        self.cores = cores
        self.gangs = gangs
        self._tasks: list[_Task] = []
        self._at = 0.0  # when the tasks' ``left`` was last brought up to date
        self._epoch = 0  # the scheduled wake-up that is still current
        self._order = itertools.count()
        self._outside_busy = False  # something beside these cores computes

    def speeds(self) -> list[float]:
        """Each running task's speed now, as a fraction of its full speed (in start order)."""
        busy = sum(t.ranks for t in self._tasks)
        share = min(1.0, self.cores / busy) if busy else 1.0
        company = len(self._tasks) > 1 or self._outside_busy
        slowdown = self.beside if company else 1.0
        return [
            (share**t.ranks if self.gangs else share) / (slowdown if t.slowed else 1.0)
            for t in self._tasks
        ]

    def run(
        self, seconds: float, ranks: int, then: Callable[[], None], slowed: bool = False
    ) -> None:
        """Start ``seconds`` of full-speed work on ``ranks`` ranks now; ``then`` at its end;
        ``slowed``: at its speed over ``beside`` while in company."""
        if seconds < 0 or ranks < 1:
            raise ValueError(f"a task needs seconds >= 0 and ranks >= 1, got {seconds}, {ranks}")
        self._advance()
        self._tasks.append(_Task(seconds, ranks, then, next(self._order), slowed))
        self._schedule()

    def set_outside_busy(self, busy: bool) -> None:
        """Whether something outside these cores computes beside them from now on (``slowed``
        tasks are then in company)."""
        if busy == self._outside_busy:
            return
        self._advance()
        self._outside_busy = busy
        self._schedule()

    def _advance(self) -> None:
        now = self.loop.now
        dt = now - self._at
        if dt > 0 and self._tasks:
            for t, speed in zip(self._tasks, self.speeds(), strict=True):
                t.left -= dt * speed
        self._at = now

    def _schedule(self) -> None:
        self._epoch += 1
        if not self._tasks:
            return
        due, first = min(
            ((max(t.left, 0.0) / s, t) for t, s in zip(self._tasks, self.speeds(), strict=True)),
            key=lambda pair: (pair[0], pair[1].order),
        )
        self.loop.at(self.loop.now + due, functools.partial(self._wake, self._epoch, first))

    def _wake(self, epoch: int, first: _Task) -> None:
        if epoch != self._epoch:
            return  # a task started or ended since: a newer wake-up is scheduled
        self._advance()
        done = [t for t in self._tasks if t is first or t.left <= _DONE_S]
        self._tasks = [t for t in self._tasks if not (t is first or t.left <= _DONE_S)]
        self._schedule()
        for t in sorted(done, key=lambda t: t.order):
            t.then()
