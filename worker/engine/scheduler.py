"""Continuous batching with chunked prefill under a token budget (FCFS, preemption by recompute).

Each step the scheduler spends ``max_num_batched_tokens``: first one token for every running
decode, then the rest of any running partial prefill, then new requests in arrival order (each may
get a partial chunk). When the KV cache runs out, the most recently admitted running request is
preempted: its blocks are freed and it goes back to the front of the queue to be recomputed.

The policy has a say before each step (``StepRequest``): decode-only or prefill-only steps, and a
cap on the sequences a step takes. Sequences of steps still in flight (pipeline micro-batches)
are ``busy``: they are neither scheduled nor preempted until their step has finished.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gearshift.worker.engine.contract import StepKind, StepRequest
from gearshift.worker.engine.sequence import FinishReason, Sequence, SequenceStatus
from gearshift.worker.kv.block_manager import BlockManager


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048


@dataclass
class ScheduledBatch:
    """This step's work: decodes (one token each) first, then prefill chunks."""

    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(n for _, n in self.prefills)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    """Owns the waiting queue and the running list; the block manager owns the blocks."""

    def __init__(self, config: SchedulerConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # KV tokens thrown away by preemptions: what re-admission recomputes (less any prefix
        # hits), the cost a policy's admission control exists to avoid.
        self.preempted_tokens = 0
        # Called with every sequence that ends (finished, aborted, failed): a policy holding
        # state of its own per sequence (a host KV slot) frees it here.
        self.on_finish: list[Callable[[Sequence], None]] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Sequence | None:
        """Remove a request wherever it is and free its blocks; None if unknown."""
        for seq in self.running:
            if seq.request_id == request_id:
                self.running.remove(seq)
                self.finish(seq, FinishReason.ABORT)
                return seq
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                self.finish(seq, FinishReason.ABORT)
                return seq
        return None

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.blocks.free_table(seq.blocks)
        for hook in self.on_finish:
            hook(seq)

    def preempt(self, seq: Sequence) -> None:
        """Send a running sequence back to the queue to be recomputed (frees its blocks)."""
        self._preempt(seq, ScheduledBatch())

    def remove_finished(self) -> None:
        self.running = [s for s in self.running if not s.is_finished]

    def schedule(
        self, request: StepRequest | None = None, busy: frozenset[str] = frozenset()
    ) -> ScheduledBatch:
        """This step's batch under ``request``; sequences whose ids are in ``busy`` wait."""
        request = request or StepRequest()
        batch = ScheduledBatch()
        if request.kind is StepKind.NONE:
            return batch
        budget = self.config.max_num_batched_tokens
        seats = request.max_seqs or self.config.max_num_seqs
        now = time.monotonic()
        free = [s for s in self.running if s.request_id not in busy]
        # Decodes first so a long prefill never starves running generations, then partial
        # prefills in admission order.
        order = []
        if request.kind is not StepKind.PREFILL:
            order += [s for s in free if s.num_tokens - s.num_computed_tokens == 1]
        if request.kind is not StepKind.DECODE:
            order += [s for s in free if s.num_tokens - s.num_computed_tokens > 1]
        for seq in order:
            if budget == 0 or len(batch.decodes) + len(batch.prefills) >= seats:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._reserve(seq, n, batch, busy):
                continue
            budget -= n
            if n == 1 and seq.num_computed_tokens == seq.num_tokens - 1:
                batch.decodes.append(seq)
            else:
                batch.prefills.append((seq, n))
        if not batch.preempted and request.kind is not StepKind.DECODE:
            seats -= len(batch.decodes) + len(batch.prefills)
            budget = self._admit(batch, budget, now, seats, request.admit_blocks)
        return batch

    def _reserve(self, seq: Sequence, n: int, batch: ScheduledBatch, busy: frozenset[str]) -> bool:
        """Blocks for ``n`` more tokens of a running sequence, preempting the youngest sequence
        that is not in flight if needed."""
        while not self.blocks.allocate(seq.blocks, seq.num_computed_tokens + n):
            victims = [s for s in self.running if s.request_id not in busy]
            if not victims:
                return False
            victim = victims[-1]
            self._preempt(victim, batch)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.blocks.free_table(seq.blocks)
        seq.status = SequenceStatus.WAITING
        self.preempted_tokens += seq.num_computed_tokens
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)
        # A preempted sequence may already sit in this step's batch; drop it from there.
        if seq in batch.decodes:
            batch.decodes.remove(seq)
        batch.prefills = [(s, n) for s, n in batch.prefills if s is not seq]

    def _admit(
        self, batch: ScheduledBatch, budget: int, now: float, seats: int, room: int | None
    ) -> int:
        while (
            self.waiting
            and budget > 0
            and seats > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self.waiting[0]
            # In arrival order: a prompt the policy's tier cannot take stops admission.
            whole = self.blocks.blocks_needed(seq.num_tokens)
            if room is not None and whole > room:
                break
            # At least one token must run to produce logits, so the last prompt token never hits.
            # prompt_logprobs need every prompt row computed: no prefix hit for them.
            limit = 0 if seq.needs_prompt_logprobs else seq.num_tokens - 1
            hit = self.blocks.match_prefix(seq.token_ids, limit, seq.cache_salt)
            computed = len(hit.block_ids) * self.blocks.block_size
            n = min(seq.num_tokens - computed, budget)
            if not self.blocks.allocate(seq.blocks, computed + n, hit):
                break
            self.waiting.popleft()
            seq.num_computed_tokens = computed
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
                seq.num_cached_tokens = computed
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.prefills.append((seq, n))
            budget -= n
            seats -= 1
            room = None if room is None else room - whole
        return budget
