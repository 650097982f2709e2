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

    def run(self) -> None:
        while self._heap:
            self.now, _, action = heapq.heappop(self._heap)
            action()
