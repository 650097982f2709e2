"""A Tetris decode instance's side of the hand-off (Tetris §4.2, Fig. 7): requests whose prompt
the prefill pool computes, admitted into continuous batching once all their KV has landed.

On the instance's leader, ``DecodeAdmission`` takes each request out of the scheduler's queue as
soon as the engine has accepted it (the instance never prefills: its steps are decode-only),
gives it KV blocks for its prompt at once (so what is in transfer is already reserved: §5.2's
virtual usage), turns every granted piece into a plan section, and, when the last piece has
landed, puts the request into the running batch with all but its last prompt token computed.
The first decode step then computes that token's row (the same KV the pool sent for it) and
samples the first output token with the request's own sampling state, so the first token obeys
every sampling parameter exactly as the rest do.

On every rank of the instance, ``ReceiveHook`` posts the receives a plan's section names, before
the plan's forward pass, and writes the rows into the rank's paged cache.

A streamed piece (``layerwise_transfer``) takes two plans: the first posts its per-layer receives
on every rank as soon as its slot is granted (they fill in the background while the pool still
computes), the second, once its member has sent every layer, waits for them and writes the rows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gearshift.worker.comm import CommGroup
from gearshift.worker.engine.model_runner import ModelRunner
from gearshift.worker.engine.plan import StepPlan
from gearshift.worker.engine.scheduler import Scheduler
from gearshift.worker.engine.sequence import FinishReason, Sequence, SequenceStatus
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.kv.block_manager import BlockManager
from gearshift.worker.policies.tetris.handoff import (
    Posted,
    complete_piece,
    post_piece,
    receive_piece,
)

log = logging.getLogger(__name__)

SECTION = "tetris_receive"  # [pieces, then per piece: src rank, rows, blocks, block ids...]


STREAM = "tetris_stream"  # [posts, per post: src, rows, tag; completes, per: tag, blocks, ids...]


def encode_stream(
    posts: list[tuple[int, int, int]], completes: list[tuple[int, list[int]]]
) -> torch.Tensor:
    """The plan section for streamed pieces: receives to post (source, rows, tag) and posted
    pieces to finish (tag, block ids; none: receive and drop)."""
    flat = [len(posts)]
    for post in posts:
        flat += list(post)
    flat.append(len(completes))
    for tag, block_ids in completes:
        flat += [tag, len(block_ids), *block_ids]
    return torch.tensor(flat, dtype=torch.int64)


def decode_stream(
    section: torch.Tensor,
) -> tuple[list[tuple[int, int, int]], list[tuple[int, list[int]]]]:
    values = section.tolist()
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


def encode_pieces(pieces: list[tuple[int, int, list[int]]]) -> torch.Tensor:
    """The plan section for ``pieces`` of (source rank, rows, block ids)."""
    flat = [len(pieces)]
    for src, rows, block_ids in pieces:
        flat += [src, rows, len(block_ids), *block_ids]
    return torch.tensor(flat, dtype=torch.int64)


def decode_pieces(section: torch.Tensor) -> list[tuple[int, int, list[int]]]:
    values = section.tolist()
    out, i = [], 1
    for _ in range(values[0]):
        src, rows, n = values[i : i + 3]
        out.append((src, rows, values[i + 3 : i + 3 + n]))
        i += 3 + n
    return out


@dataclass
class ReceiveHook:
    """Every decode rank: the plan's pieces, received before its forward pass (``world``: the
    group's global ranks). A piece that fails (its sender died mid-send) is recorded, and the
    step goes on so the instance's ranks stay in step."""

    world: CommGroup
    failed_sources: list[int] = field(default_factory=list)
    # A prefill instance's index -> what ``receive_piece`` takes as its source (its ranks and
    # the heads each sends this rank, for TP > 1); None: the index is the rank (TP 1).
    sources: Callable[[int], int | list[tuple[int, int]]] | None = None

    posted: dict[int, tuple[int, Posted]] = field(default_factory=dict)  # tag -> (src, recvs)

    def _source(self, src: int) -> int | list[tuple[int, int]]:
        return src if self.sources is None else self.sources(src)

    def before_step(self, runner: ModelRunner, plan: StepPlan) -> None:
        section = plan.section(SECTION)
        for src, rows, block_ids in decode_pieces(section) if section is not None else []:
            try:
                receive_piece(self._source(src), rows, self.world, runner.kv_caches, block_ids)
            except RuntimeError as exc:
                log.error("KV piece from rank %d failed: %s", src, str(exc).splitlines()[0])
                self.failed_sources.append(src)
        section = plan.section(STREAM)
        if section is None:
            return
        posts, completes = decode_stream(section)
        for src, rows, tag in posts:
            post = post_piece(self._source(src), rows, self.world, runner.kv_caches, tag)
            self.posted[tag] = (src, post)
        for tag, block_ids in completes:
            src, post = self.posted.pop(tag)
            try:
                complete_piece(post, runner.kv_caches, block_ids)
            except RuntimeError as exc:
                log.error("KV stream from rank %d failed: %s", src, str(exc).splitlines()[0])
                self.failed_sources.append(src)

    def close(self) -> None:
        return None


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

    def plan_sections(self) -> dict[str, torch.Tensor]:
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
