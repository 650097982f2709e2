"""The decode instance's receive manager: transfer slots granted by handshake (Tetris §4.2,
Fig. 7).

A transfer backend needs a buffer on the decode device, so a decode instance has only ``slots`` of
them, numbered: a granted piece travels on its slot's channel (``handoff.py``). Before sending a
piece of a request's KV, the prefill side's send manager handshakes for a slot; when slots are
short, waiting requests are served in the order of their *first* handshake, and a request keeps that
priority until all its pieces have landed, so later chunks of a started request are never starved by
newer requests (the backend starvation of §4.2). A request is handed to the decode scheduler only
once every piece it announced has landed; until then its rows count as virtual usage (Llumnix's,
§5.2), which decode placement reads.

Thread-safe: handshakes block (bounded) on a condition variable; the manager has no thread.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field


class TransferError(RuntimeError):
    """A handshake that cannot be granted (timed out, aborted, unknown piece)."""


@dataclass
class _Request:
    order: int  # first-handshake order
    pieces: int  # pieces announced
    rows: int  # KV rows it will hold (virtual usage until admitted)
    landed: int = 0
    waiting: int = 0  # handshakes blocked for a slot
    slots: list[int] = field(default_factory=list)  # slots it holds, in grant order
    aborted: bool = False


@dataclass
class ReceiveManager:
    """Transfer slots of one decode instance, granted in first-handshake order."""

    slots: int
    clock: Callable[[], float] = time.monotonic
    grants: list[str] = field(default_factory=list)  # request ids in grant order (a log)
    _requests: dict[str, _Request] = field(default_factory=dict)
    _ready: list[str] = field(default_factory=list)
    _free: list[int] = field(default_factory=list)  # free slot numbers, lowest first
    _orders: itertools.count[int] = field(default_factory=itertools.count)
    _cond: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"a decode instance needs at least one transfer slot: {self.slots}")
        self._free = list(range(self.slots))

    def announce(self, request_id: str, pieces: int, rows: int) -> None:
        """The first handshake of a request: how many pieces will come and the rows they hold
        (counted as virtual usage from now on). Repeating it is a no-op."""
        with self._cond:
            if request_id not in self._requests:
                if pieces < 1 or rows < 0:
                    raise TransferError(f"{request_id}: {pieces} pieces, {rows} rows")
                self._requests[request_id] = _Request(next(self._orders), pieces, rows)

    def acquire(self, request_id: str, timeout_s: float) -> int:
        """Handshake for one piece: returns the slot granted to it (the oldest waiting request
        goes first); raises TransferError after ``timeout_s`` or if it was aborted."""
        deadline = self.clock() + timeout_s
        with self._cond:
            req = self._requests.get(request_id)
            if req is None:
                raise TransferError(f"{request_id}: no handshake announced it")
            if len(req.slots) + req.landed + req.waiting >= req.pieces:
                raise TransferError(f"{request_id}: more pieces than the {req.pieces} announced")
            req.waiting += 1
            try:
                while not (req.aborted or (self._free and self._first_waiting() is req)):
                    left = deadline - self.clock()
                    timed_out = left <= 0 or not self._cond.wait(left)
                    granted = req.aborted or (self._free and self._first_waiting() is req)
                    if timed_out and not granted:
                        raise TransferError(f"{request_id}: no transfer slot within {timeout_s} s")
                if req.aborted:
                    raise TransferError(f"{request_id}: aborted")
            finally:
                req.waiting -= 1
            slot = self._free.pop(0)
            req.slots.append(slot)
            self.grants.append(request_id)
            self._cond.notify_all()
            return slot

    def landed(self, request_id: str, slot: int | None = None) -> None:
        """A granted piece has arrived on ``slot`` (None: the request's oldest): the slot
        frees; the request is ready once all landed."""
        with self._cond:
            req = self._requests[request_id]
            if not req.slots or (slot is not None and slot not in req.slots):
                raise TransferError(f"{request_id}: a piece landed without a slot")
            freed = req.slots[0] if slot is None else slot
            req.slots.remove(freed)
            req.landed += 1
            self._free = sorted((*self._free, freed))
            if req.landed == req.pieces:
                del self._requests[request_id]
                self._ready.append(request_id)
            self._cond.notify_all()

    def abort(self, request_id: str) -> None:
        """Forget a request: its slots free, its waiting handshakes fail, no virtual usage."""
        with self._cond:
            req = self._requests.pop(request_id, None)
            if req is not None:
                req.aborted = True
                self._free = sorted((*self._free, *req.slots))
                req.slots = []
            if request_id in self._ready:
                self._ready.remove(request_id)
            self._cond.notify_all()

    def take_ready(self) -> list[str]:
        """Requests whose KV has fully landed, for the decode scheduler to admit (in order)."""
        with self._cond:
            ready, self._ready = self._ready, []
            return ready

    @property
    def virtual_rows(self) -> int:
        """KV rows of requests still in transfer (§5.2's virtual usage)."""
        with self._cond:
            return sum(r.rows for r in self._requests.values())

    @property
    def free_slots(self) -> int:
        with self._cond:
            return len(self._free)

    @property
    def waiting_handshakes(self) -> int:
        with self._cond:
            return sum(r.waiting for r in self._requests.values())

    @property
    def in_transfer(self) -> int:
        with self._cond:
            return len(self._requests)

    def _first_waiting(self) -> _Request | None:
        waiting = [r for r in self._requests.values() if r.waiting and not r.aborted]
        return min(waiting, key=lambda r: r.order) if waiting else None
