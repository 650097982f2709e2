"""Requests waiting in the router for room on one group, oldest first (Tetris: no decode
instance has the KV slots free for them yet).

A request whose planner answers ``NoRoomYet`` (``policy_control.py``) is not refused: it waits
here, as a serving engine queues what does not fit its KV cache. Each stats poll of the group
(``Group.run_poller``) plans the waiting requests again, oldest first, and stops at the first
that still has no room: a later request never takes room ahead of an older one, even a smaller
one that would fit, and a request that arrives while others wait queues behind them. A waiter
that leaves (its client disconnected, its wait bound passed, the drain cut it off) is taken out
at once and holds nothing; when it was the oldest, the next one is planned at once.

A waiting request keeps its lease on the group, so it counts against
``max_requests_per_group`` (the 429 bound) and in the group's load.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from dataclasses import dataclass, field

from gearshift.operator.router.policy_control import NoRoomYet


class LeftGroup(ConnectionError):
    """The group stopped serving (down, drained, removed) while the request waited."""


@dataclass(eq=False)
class _Waiter:
    attempt: Callable[[], None]  # plans the request; raises NoRoomYet while there is no room
    future: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class RoomQueue:
    """One group's requests waiting for room, oldest first (see the module docstring)."""

    def __init__(self) -> None:
        self._waiters: collections.deque[_Waiter] = collections.deque()

    def __len__(self) -> int:
        """Requests waiting now."""
        return len(self._waiters)

    async def admit(
        self,
        attempt: Callable[[], None],
        timeout_s: float,
        stop: asyncio.Future[None] | None = None,
    ) -> None:
        """Plan a request (``attempt``): at once when nobody waits and there is room, else once
        the requests before it are planned and a poll reports room for it.

        Raises what ``attempt`` raises other than ``NoRoomYet``, ``LeftGroup`` when the group
        stops serving, and ``TimeoutError`` when ``timeout_s`` passes or ``stop`` is done first.
        """
        if not self._waiters:
            try:
                attempt()
                return
            except NoRoomYet:
                pass
        waiter = _Waiter(attempt)
        self._waiters.append(waiter)
        try:
            watch = {waiter.future} if stop is None else {waiter.future, stop}
            await asyncio.wait(watch, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if not waiter.future.done():
                raise TimeoutError
            waiter.future.result()  # None once planned; else what stopped it
        finally:
            self._leave(waiter)

    def _leave(self, waiter: _Waiter) -> None:
        """Take a waiter out (its request left, or was planned); it holds nothing after."""
        if not waiter.future.done():
            waiter.future.cancel()
        elif not waiter.future.cancelled():
            waiter.future.exception()  # retrieved: a waiter cancelled meanwhile logs nothing
        if self._waiters and self._waiters[0] is waiter:
            self._waiters.popleft()
            self.pump()  # the next one may fit the room the oldest could not
        elif waiter in self._waiters:
            self._waiters.remove(waiter)

    def pump(self) -> None:
        """Plan the waiting requests oldest first, until one still has no room (each stats
        poll of the group calls this)."""
        while self._waiters:
            waiter = self._waiters[0]
            if waiter.future.done():
                self._waiters.popleft()
                continue
            try:
                waiter.attempt()
            except NoRoomYet:
                return
            # Its plan failed another way: its client hears why; the poller that pumps runs on.
            except Exception as exc:  # noqa: BLE001
                self._waiters.popleft()
                waiter.future.set_exception(exc)
                continue
            self._waiters.popleft()
            waiter.future.set_result(None)

    def fail_all(self, message: str) -> None:
        """The group stopped serving: every waiter leaves with ``LeftGroup(message)``."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.future.done():
                waiter.future.set_exception(LeftGroup(message))
