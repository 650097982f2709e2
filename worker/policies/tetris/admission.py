"""A Tetris decode instance leader's requests in transfer (Tetris §4.2, Fig. 7), and the plan
sections that carry their pieces to the instance's ranks.

``DecodeAdmission`` takes each request out of the scheduler's queue as soon as the engine has
accepted it (the instance never prefills: its steps are decode-only), gives it KV blocks for its
prompt at once (so what is in transfer is already reserved: §5.2's virtual usage), turns every
granted piece into a plan section, and, when the last piece has landed, puts the request into
the running batch with all but its last prompt token computed. The first decode step then
computes that token's row (the same KV the pool sent for it) and samples the first output token
with the request's own sampling state, so the first token obeys every sampling parameter exactly
as the rest do. On every rank, ``decode.ReceiveHook`` acts on the sections.

Torch-free: the simulator (operator/sim/tetris_sim.py) admits requests with this same class.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gearshift.worker.engine.scheduler import Scheduler
from gearshift.worker.engine.sequence import FinishReason, Sequence, SequenceStatus
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.kv.block_manager import BlockManager

if TYPE_CHECKING:
    from gearshift.worker.policies.tetris.decode import ReceiveHook

SECTION = "tetris_receive"  # [pieces, then per piece: src rank, rows, blocks, block ids...]


STREAM = "tetris_stream"  # [posts, per post: src, rows, tag; completes, per: tag, blocks, ids...]


def encode_stream(
    posts: list[tuple[int, int, int]], completes: list[tuple[int, list[int]]]
) -> list[int]:
    """The plan section for streamed pieces: receives to post (source, rows, tag) and posted
    pieces to finish (tag, block ids; none: receive and drop)."""
    flat = [len(posts)]
    for post in posts:
        flat += list(post)
    flat.append(len(completes))
    for tag, block_ids in completes:
        flat += [tag, len(block_ids), *block_ids]
    return flat


def decode_stream(
    values: list[int],
) -> tuple[list[tuple[int, int, int]], list[tuple[int, list[int]]]]:
    posts = []
    for k in range(values[0]):
        src, rows, tag = values[1 + 3 * k : 4 + 3 * k]
        posts.append((src, rows, tag))
    i = 1 + 3 * values[0]
    completes = []
    for _ in range(values[i]):
        tag, n = values[i + 1 : i + 3]
        completes.append((tag, values[i + 3 : i + 3 + n]))
        i += 2 + n
    return posts, completes


def encode_pieces(pieces: list[tuple[int, int, list[int]]]) -> list[int]:
    """The plan section for ``pieces`` of (source rank, rows, block ids)."""
    flat = [len(pieces)]
    for src, rows, block_ids in pieces:
        flat += [src, rows, len(block_ids), *block_ids]
    return flat


def decode_pieces(values: list[int]) -> list[tuple[int, int, list[int]]]:
    out, i = [], 1
    for _ in range(values[0]):
        src, rows, n = values[i : i + 3]
        out.append((src, rows, values[i + 3 : i + 3 + n]))
        i += 3 + n
    return out


@dataclass
class _Incoming:
    seq: Sequence
    pieces: int
    landed: int = 0
    aborted: bool = False  # its blocks free once the receives already granted have run


@dataclass
class DecodeAdmission:
    """A decode instance leader's requests in transfer (see the module docstring)."""

    scheduler: Scheduler
    blocks: BlockManager
    hook: ReceiveHook | None = None
    incoming: dict[str, _Incoming] = field(default_factory=dict)
    _queued: list[tuple[str, int, int, int]] = field(default_factory=list)  # rid, src, rows, piece
    # Pieces whose receives this plan runs: (rid, src, piece, dropped: its sender failed it).
    _submitted: list[tuple[str, int, int, bool]] = field(default_factory=list)
    _posts: list[tuple[int, int, int]] = field(default_factory=list)  # src, rows, tag
    _completes: list[tuple[str, int, int, int, bool]] = field(default_factory=list)
    _streaming: dict[int, str] = field(default_factory=dict)  # posted tag -> rid
    _landed: list[tuple[str, int]] = field(default_factory=list)  # (rid, piece), to report
    _failed: list[tuple[str, str]] = field(default_factory=list)  # (rid, why), to report
    admitted: int = 0

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

    def receive(self, request_id: str, src: int, rows: int, piece: int) -> None:
        """A granted piece: its receive goes into the next plan. Its sender is already sending,
        so a piece of a request this instance no longer holds is still received (and dropped):
        no sender is ever left blocked."""
        self._queued.append((request_id, src, rows, piece))

    def post(self, request_id: str, src: int, rows: int, piece: int, tag: int) -> None:
        """A streamed piece was granted: its receives go into the next plan (posted on every
        rank; they finish with ``complete``)."""
        del piece
        self._posts.append((src, rows, tag))
        self._streaming[tag] = request_id

    def complete(self, request_id: str, src: int, piece: int, tag: int, dropped: int) -> None:
        """A streamed piece's member has sent every layer (``dropped``: it sent zeros, its
        prefill failed, or it died): the next plan waits for the rows and writes them."""
        self._completes.append((request_id, src, piece, tag, bool(dropped)))

    def _pending(self, request_id: str) -> bool:
        """Receives of ``request_id`` still to run (they hold its blocks until they have)."""
        queued = [q[0] for q in self._queued + self._submitted + self._completes]
        return request_id in queued or request_id in self._streaming.values()

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

    def _blocks(self, request_id: str, dropped: bool = False) -> list[int]:
        entry = self.incoming.get(request_id)
        return entry.seq.blocks.block_ids if entry is not None and not dropped else []

    def plan_sections(self) -> dict[str, list[int]]:
        sections = {}
        if self._queued:
            queued, self._queued = self._queued, []
            self._submitted = [(rid, src, piece, False) for rid, src, _, piece in queued]
            pieces = [(src, rows, self._blocks(rid)) for rid, src, rows, _ in queued]
            sections[SECTION] = encode_pieces(pieces)
        if self._posts or self._completes:
            posts, self._posts = self._posts, []
            completes, self._completes = self._completes, []
            for _, _, _, tag, _ in completes:
                self._streaming.pop(tag, None)
            self._submitted += [(rid, src, piece, drop) for rid, src, piece, _, drop in completes]
            finish = [(tag, self._blocks(rid, drop)) for rid, _, _, tag, drop in completes]
            sections[STREAM] = encode_stream(posts, finish)
        return sections

    def step_submitted(self) -> None:
        """The plan's receives ran on this rank: count the pieces, admit complete requests."""
        submitted, self._submitted = self._submitted, []
        failed = set(self.hook.failed_sources) if self.hook is not None else set()
        if self.hook is not None:
            self.hook.failed_sources.clear()
        for rid, src, piece, dropped in submitted:
            entry = self.incoming.get(rid)
            if entry is None:
                continue  # received and dropped
            if entry.aborted:
                if not self._pending(rid):
                    del self.incoming[rid]
                    self.scheduler.finish(entry.seq, FinishReason.ABORT)
                continue
            if src in failed or dropped:
                self.incoming.pop(rid)
                self.scheduler.finish(entry.seq, FinishReason.ERROR)
                self._failed.append((rid, f"the KV transfer from prefill rank {src} failed"))
                continue
            entry.landed += 1
            self._landed.append((rid, piece))
            if entry.landed == entry.pieces:
                self._admit(self.incoming.pop(rid).seq)

    def _admit(self, seq: Sequence) -> None:
        """Into the running batch: the prompt's KV is all here; its last token runs as the
        first decode row (see the module docstring)."""
        seq.num_computed_tokens = seq.num_prompt_tokens - 1
        seq.status = SequenceStatus.RUNNING
        seq.first_scheduled_time = time.monotonic()
        self.scheduler.running.append(seq)
        self.admitted += 1

    def take_reports(self) -> tuple[list[tuple[str, int]], list[tuple[str, str]]]:
        landed, self._landed = self._landed, []
        failed, self._failed = self._failed, []
        return landed, failed

    def reserved_rows(self) -> int:
        """Prompt rows of requests still in transfer (their blocks are held: virtual usage)."""
        return sum(e.seq.num_prompt_tokens for e in self.incoming.values())
