"""The simulated clock and its event queue: events run in time order, ties in insertion order."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class EventLoop:
    """A heap of (time, order, action); ``run`` advances ``now`` to each event and calls it."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def at(self, time: float, action: Callable[[], None]) -> None:
        if time < self.now:
            raise ValueError(f"cannot schedule an event in the past ({time} < {self.now})")
        heapq.heappush(self._heap, (time, next(self._order), action))

    def next_time(self) -> float:
        """When the next event is due (inf: none is)."""
        return self._heap[0][0] if self._heap else float("inf")

    def advance(self, time: float) -> None:
        """Move the clock to ``time`` without an event: nothing may be due before it."""
        if time < self.now or time > self.next_time():
            raise ValueError(f"cannot advance to {time}: now {self.now}, next {self.next_time()}")
        self.now = time

    def run(self) -> None:
        while self._heap:
            self.now, _, action = heapq.heappop(self._heap)
            action()
