"""Seesaw §5.2 asynchronous swap-in: which sequences are resident on every rank and may decode.

"Once the prefetcher completes moving the KV cache for certain sequences, it notifies the
scheduler via a shared queue, allowing those sequences to be scheduled for decoding tasks later."
Here the queue is a board in the group's host KV segment (one node's shared memory, like the
pages): every plan that carries swap-ins gives them a ticket (1, 2, ...); each rank's
prefetcher copies its shard in ticket order and then writes the ticket into its own slot; the
leader's scheduler lets a sequence decode once every rank's slot has reached its ticket. One
writer per slot and monotonic values: no lock, and a reader never sees a ticket whose copies
are not done (the slot is written after the copies, on the same thread).

The board also orders swap-outs before the swap-ins that read their pages, in place of a
barrier of the whole group per swap-in: plans that carry swap-outs are numbered too, each rank
writes the last one whose pages it has written into a slot of its own, and a rank's swap-in
waits (on this shared memory, only when a writer is behind) until every rank has written the
swap-outs that came before it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

SLOT_BYTES = 8


def board_bytes(world_size: int) -> int:
    """Slots 0..world-1: the last swap-out rank r wrote; then the last swap-in ticket the
    leader sent, then (slot world + 1 + r) the last one rank r finished."""
    return SLOT_BYTES * (2 * world_size + 1)


class Slots(Protocol):
    """int64 slots: an int64 tensor view of the host KV segment's tail on a node, a plain list in
    the simulator (which runs this board without torch)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...

    def __setitem__(self, index: int, value: int) -> None: ...


class ReadinessBoard:
    """The shared slots: ``slots`` the swap-in board (sent, then one slot per rank),
    ``out_slots`` the last swap-out each rank wrote."""

    def __init__(self, slots: Slots, out_slots: Slots) -> None:
        if len(out_slots) != len(slots) - 1:
            raise ValueError(f"{len(out_slots)} swap-out slots for {len(slots) - 1} ranks")
        self.slots = slots
        self.out_slots = out_slots

    @property
    def world_size(self) -> int:
        return len(self.slots) - 1

    def wrote_out(self, rank: int, number: int) -> None:
        """Rank ``rank`` has written the pages of every swap-out up to plan-number ``number``."""
        self.out_slots[rank] = number

    def written(self) -> tuple[int, ...]:
        """The last swap-out each rank wrote, rank by rank."""
        return tuple(int(self.out_slots[r]) for r in range(len(self.out_slots)))

    def wait_written(self, number: int, timeout: float, poll: float = 0.0005) -> bool:
        """Until every rank has written swap-out ``number`` (and the ones before); False when
        ``timeout`` seconds pass first (a writer is gone)."""
        deadline = time.monotonic() + timeout
        while min(self.written()) < number:
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll)
        return True

    def sent(self, ticket: int) -> None:
        """Leader: a plan with swap-ins of ``ticket`` went out (for operators and tests)."""
        self.slots[0] = ticket

    def report(self, rank: int, ticket: int) -> None:
        """Rank ``rank``'s prefetcher: every copy of ``ticket`` (and of the ones before) is done."""
        self.slots[1 + rank] = ticket

    def finished(self) -> int:
        """The last ticket every rank has finished."""
        return min(int(self.slots[r]) for r in range(1, len(self.slots)))

    def snapshot(self) -> tuple[int, ...]:
        """(sent, rank 0's, rank 1's, ...) at one moment."""
        return tuple(int(self.slots[r]) for r in range(len(self.slots)))


@dataclass(frozen=True)
class SwapEvent:
    """One entry of the swap-in log: a ticket sent with a plan, or found ready by the leader."""

    plan: int  # plans submitted before it: "sent" rides in that plan, "ready" may decode in it
    what: str  # "sent" | "ready" | "retired" (aborted while copying: its blocks are free now)
    ticket: int
    request_ids: tuple[str, ...]
    board: tuple[int, ...]  # ReadinessBoard.snapshot() when the leader looked


@dataclass
class _Pending:
    ticket: int
    since: float  # time.monotonic() when its swap-in was sent
    blocks: list[int]  # device blocks the copies write; held by the queue until they are done


@dataclass
class _Retired:
    """A sequence that ended while its copies ran: blocks and pages wait for ``ticket``."""

    ticket: int
    blocks: list[int]
    pages: list[int]
    request_id: str


@dataclass
class SwapInQueue:
    """The leader's swap-ins in flight: sequences wait here until every rank has reported their
    ticket. Device blocks under copy stay referenced by the queue, so a sequence aborted mid
    swap-in gives its blocks (and host pages) back only once no rank writes or reads them."""

    board: ReadinessBoard
    release_blocks: Callable[[list[int]], None]
    release_pages: Callable[[list[int]], object]
    pending: dict[str, _Pending] = field(default_factory=dict)
    retired: list[_Retired] = field(default_factory=list)
    log: list[SwapEvent] = field(default_factory=list)
    next_ticket: int = 1
    wait_seconds: float = 0.0  # summed over sequences: sent until every rank had copied them

    def __len__(self) -> int:
        return len(self.pending)

    @property
    def busy(self) -> bool:
        """Copies some rank may still run (of waiting or of retired sequences)."""
        return bool(self.pending or self.retired)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.pending

    def add(self, request_id: str, ticket: int, blocks: list[int]) -> None:
        self.pending[request_id] = _Pending(ticket, time.monotonic(), list(blocks))

    def sent(self, ticket: int, plan: int) -> None:
        self.board.sent(ticket)
        rids = tuple(r for r, p in self.pending.items() if p.ticket == ticket)
        self.log.append(SwapEvent(plan, "sent", ticket, rids, self.board.snapshot()))

    def collect(self, plan: int) -> list[str]:
        """Sequences every rank has copied since the last call (they may decode from ``plan``
        on); retired copies that are done give their blocks and pages back."""
        board = self.board.snapshot()
        done = min(board[1:])
        now = time.monotonic()
        ready = [r for r, p in self.pending.items() if p.ticket <= done]
        for rid in ready:
            p = self.pending.pop(rid)
            self.wait_seconds += now - p.since
            self.release_blocks(p.blocks)
            self.log.append(SwapEvent(plan, "ready", p.ticket, (rid,), board))
        for entry in [e for e in self.retired if e.ticket <= done]:
            self.retired.remove(entry)
            self.release_blocks(entry.blocks)
            self.release_pages(entry.pages)
            self.log.append(SwapEvent(plan, "retired", entry.ticket, (entry.request_id,), board))
        return ready

    def retire(self, request_id: str, pages: list[int]) -> None:
        """``request_id`` ended while its copies run: its pages and blocks wait for them."""
        p = self.pending.pop(request_id)
        self.retired.append(_Retired(p.ticket, p.blocks, pages, request_id))

    def wait(self, seconds: float, poll: float = 0.001) -> bool:
        """Sleep until some pending or retired ticket is done, at most ``seconds``; whether one
        is."""
        tickets = [p.ticket for p in self.pending.values()] + [e.ticket for e in self.retired]
        if not tickets:
            return False
        first = min(tickets)
        deadline = time.monotonic() + seconds
        while self.board.finished() < first:
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll)
        return True
