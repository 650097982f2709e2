"""A Tetris decode instance leader's requests in transfer (Tetris §4.2, Fig. 7), and the plan
sections that carry their pieces to the instance's ranks.

``DecodeAdmission`` takes each request out of the scheduler's queue as soon as the engine has
accepted it (the pool prefills it: the instance's steps are decode-only), gives it KV blocks for its
prompt at once (so what is in transfer is already reserved: §5.2's virtual usage), turns every
granted piece into a plan section, and, when the last piece has landed, puts the request into
the running batch with all but its last prompt token computed. The first decode step then
computes that token's row (the same KV the pool sent for it) and samples the first output token
with the request's own sampling state, so the first token obeys every sampling parameter exactly
as the rest do. On every rank, ``decode.ReceiveHook`` acts on the sections: each piece on its
transfer slot's channel, its messages labelled with its grant number (``handoff.py``).

A running request can still be preempted, when the outputs of those placed here outgrow the
blocks left (placement reserves only what a request holds in transfer). The engine then frees
its blocks and queues it to be recomputed, and only this instance can: the pool handed it over
long ago. So while such a request waits or is part way through its recompute, a step may
prefill (``DecodeAdmission.step_request``), as any engine recomputes what it preempted.

Torch-free: the simulator (operator/sim/tetris_sim.py) admits requests with this same class.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gearshift.worker.engine.contract import StepKind, StepRequest
from gearshift.worker.engine.scheduler import Scheduler
from gearshift.worker.engine.sequence import FinishReason, Sequence, SequenceStatus
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.kv.block_manager import BlockManager

if TYPE_CHECKING:
    from gearshift.worker.policies.tetris.decode import ReceiveHook

log = logging.getLogger(__name__)

# [pieces, then per piece: src, slot, xfer, rows, blocks, block ids...]
SECTION = "tetris_receive"
# [posts, per post: src, slot, xfer, rows; completes, per complete: xfer, blocks, block ids...]
STREAM = "tetris_stream"

Post = tuple[int, int, int, int]  # a streamed piece's receives to post: (src, slot, xfer, rows)
Piece = tuple[int, int, int, int, list[int]]  # a whole piece: (src, slot, xfer, rows, blocks)


def encode_stream(posts: list[Post], completes: list[tuple[int, list[int]]]) -> list[int]:
    """The plan section for streamed pieces: receives to post and posted pieces to finish
    (grant number, block ids; none: receive and drop)."""
    flat = [len(posts)]
    for post in posts:
        flat += list(post)
    flat.append(len(completes))
    for xfer, block_ids in completes:
        flat += [xfer, len(block_ids), *block_ids]
    return flat


def decode_stream(values: list[int]) -> tuple[list[Post], list[tuple[int, list[int]]]]:
    posts: list[Post] = []
    for k in range(values[0]):
        src, slot, xfer, rows = values[1 + 4 * k : 5 + 4 * k]
        posts.append((src, slot, xfer, rows))
    i = 1 + 4 * values[0]
    completes = []
    for _ in range(values[i]):
        xfer, n = values[i + 1 : i + 3]
        completes.append((xfer, values[i + 3 : i + 3 + n]))
        i += 2 + n
    return posts, completes


def encode_pieces(pieces: list[Piece]) -> list[int]:
    """The plan section for whole ``pieces``."""
    flat = [len(pieces)]
    for src, slot, xfer, rows, block_ids in pieces:
        flat += [src, slot, xfer, rows, len(block_ids), *block_ids]
    return flat


def decode_pieces(values: list[int]) -> list[Piece]:
    out, i = [], 1
    for _ in range(values[0]):
        src, slot, xfer, rows, n = values[i : i + 5]
        out.append((src, slot, xfer, rows, values[i + 5 : i + 5 + n]))
        i += 5 + n
    return out


@dataclass
class _Incoming:
    seq: Sequence
    pieces: int
    landed: int = 0
    aborted: bool = False  # its blocks free once the receives already granted have run


@dataclass(frozen=True)
class _Granted:
    """A granted piece on this instance: from prefill instance ``src``, on slot ``slot`` as
    grant ``xfer``; ``dropped``: its sender failed it (zeros, or it died)."""

    rid: str
    src: int
    piece: int
    slot: int
    xfer: int
    rows: int = 0
    dropped: bool = False


@dataclass
class DecodeAdmission:
    """A decode instance leader's requests in transfer (see the module docstring)."""

    scheduler: Scheduler
    blocks: BlockManager
    hook: ReceiveHook | None = None
    incoming: dict[str, _Incoming] = field(default_factory=dict)
    _queued: list[_Granted] = field(default_factory=list)  # whole pieces for the next plan
    _submitted: list[_Granted] = field(default_factory=list)  # pieces this plan receives
    _posts: list[_Granted] = field(default_factory=list)  # streamed pieces to post
    _completes: list[_Granted] = field(default_factory=list)  # streamed pieces to finish
    _streaming: dict[int, _Granted] = field(default_factory=dict)  # posted, by grant number
    _landed: list[tuple[str, int, int]] = field(default_factory=list)  # (rid, piece, slot)
    _failed: list[tuple[str, str]] = field(default_factory=list)  # (rid, why), to report
    admitted: int = 0

    def step_request(self) -> StepRequest:
        """The instance's next step: decode-only, unless a request it preempted waits in the
        scheduler's queue (``expect`` takes every new one out at once) or is still being
        recomputed (more than one token to compute: a landed request has exactly one), which
        a step may then prefill."""
        sched = self.scheduler
        if sched.waiting or any(s.num_tokens - s.num_computed_tokens > 1 for s in sched.running):
            return StepRequest()
        return StepRequest(StepKind.DECODE)

    def expect(self, request_id: str, pieces: int) -> None:
        """The engine has just queued ``request_id``: take it from the queue and reserve its
        prompt's blocks (raises InvalidRequestError, releasing everything, if they do not fit)."""
        seq = next((s for s in self.scheduler.waiting if s.request_id == request_id), None)
        if seq is None:
            raise InvalidRequestError("request_id", f"{request_id!r} is not queued here")
        self.scheduler.waiting.remove(seq)
        if not self.blocks.allocate(seq.blocks, seq.num_prompt_tokens):
            self.scheduler.finish(seq, FinishReason.ERROR)
            raise InvalidRequestError(
                "prompt",
                f"the decode instance has no room for the prompt's {seq.num_prompt_tokens} "
                "tokens of KV now",
            )
        self.incoming[request_id] = _Incoming(seq, pieces)

    def receive(
        self, request_id: str, src: int, rows: int, piece: int, slot: int, xfer: int
    ) -> None:
        """A granted piece: its receive goes into the next plan. Its sender is already sending,
        so a piece of a request this instance no longer holds is still received (and dropped):
        no sender is ever left blocked."""
        self._queued.append(_Granted(request_id, src, piece, slot, xfer, rows))

    def post(self, request_id: str, src: int, rows: int, piece: int, slot: int, xfer: int) -> None:
        """A streamed piece was granted: its receives go into the next plan (posted on every
        rank; they finish with ``complete``)."""
        granted = _Granted(request_id, src, piece, slot, xfer, rows)
        self._posts.append(granted)
        self._streaming[xfer] = granted

    def complete(self, request_id: str, xfer: int, dropped: bool) -> None:
        """A streamed piece's member has sent every layer (``dropped``: it sent zeros, its
        prefill failed, or it died): the next plan waits for the rows and writes them."""
        granted = self._streaming.get(xfer)
        if granted is None or granted.rid != request_id:  # the controller's mistake: say so
            log.error("%s: no streamed piece %d was posted here", request_id, xfer)
            return
        self._completes.append(dataclasses.replace(granted, dropped=bool(dropped)))

    def _pending(self, request_id: str) -> bool:
        """Receives of ``request_id`` still to run (they hold its blocks until they have)."""
        waiting = self._queued + self._submitted + self._completes
        return any(g.rid == request_id for g in (*waiting, *self._streaming.values()))

    def abort(self, request_id: str) -> None:
        """Forget a request in transfer and free its blocks (no-op if admitted or unknown); a
        granted piece still to be received keeps them until it has landed."""
        entry = self.incoming.get(request_id)
        if entry is None:
            return
        if self._pending(request_id):
            entry.aborted = True
            return
        del self.incoming[request_id]
        self.scheduler.finish(entry.seq, FinishReason.ABORT)

    @property
    def has_work(self) -> bool:
        return bool(self._queued or self._posts or self._completes or self._landed or self._failed)

    def _blocks(self, granted: _Granted) -> list[int]:
        entry = self.incoming.get(granted.rid)
        return entry.seq.blocks.block_ids if entry is not None and not granted.dropped else []

    def plan_sections(self) -> dict[str, list[int]]:
        sections = {}
        if self._queued:
            queued, self._queued = self._queued, []
            self._submitted = list(queued)
            pieces = [(g.src, g.slot, g.xfer, g.rows, self._blocks(g)) for g in queued]
            sections[SECTION] = encode_pieces(pieces)
        if self._posts or self._completes:
            posts, self._posts = self._posts, []
            completes, self._completes = self._completes, []
            for g in completes:
                self._streaming.pop(g.xfer, None)
            self._submitted += completes
            sections[STREAM] = encode_stream(
                [(g.src, g.slot, g.xfer, g.rows) for g in posts],
                [(g.xfer, self._blocks(g)) for g in completes],
            )
        return sections

    def step_submitted(self) -> None:
        """The plan's receives ran on this rank: count the pieces, admit complete requests."""
        submitted, self._submitted = self._submitted, []
        failed = set(self.hook.failed_sources) if self.hook is not None else set()
        if self.hook is not None:
            self.hook.failed_sources.clear()
        for g in submitted:
            entry = self.incoming.get(g.rid)
            if entry is None:
                continue  # received and dropped
            if entry.aborted:
                if not self._pending(g.rid):
                    del self.incoming[g.rid]
                    self.scheduler.finish(entry.seq, FinishReason.ABORT)
                continue
            if g.src in failed or g.dropped:
                self.incoming.pop(g.rid)
                self.scheduler.finish(entry.seq, FinishReason.ERROR)
                self._failed.append((g.rid, f"the KV transfer from prefill rank {g.src} failed"))
                continue
            entry.landed += 1
            self._landed.append((g.rid, g.piece, g.slot))
            if entry.landed == entry.pieces:
                self._admit(self.incoming.pop(g.rid).seq)

    def _admit(self, seq: Sequence) -> None:
        """Into the running batch: the prompt's KV is all here; its last token runs as the
        first decode row (see the module docstring)."""
        seq.num_computed_tokens = seq.num_prompt_tokens - 1
        seq.status = SequenceStatus.RUNNING
        seq.first_scheduled_time = time.monotonic()
        self.scheduler.running.append(seq)
        self.admitted += 1

    def take_reports(self) -> tuple[list[tuple[str, int, int]], list[tuple[str, str]]]:
        landed, self._landed = self._landed, []
        failed, self._failed = self._failed, []
        return landed, failed

    def reserved_rows(self) -> int:
        """Prompt rows of requests still in transfer (their blocks are held: virtual usage)."""
        return sum(e.seq.num_prompt_tokens for e in self.incoming.values())
