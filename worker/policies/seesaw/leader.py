"""The leader's half of Seesaw: transition-minimising scheduling over the host KV tier (§4.2,
Fig. 6).

Prefill phase: only prefill steps run (on the prefill gear); every prompt whose prefill is done
moves to the host store and its device blocks free. A prompt is admitted only if its whole KV
fits the host pages and the device blocks the prompts being prefilled leave free (the step's
``admit_blocks``), so no prefill is preempted and none finds the store full: nothing is
recomputed. The phase ends when the host store's usage (counting the pages the prompts being
prefilled will take) reaches ``switch_to_decode_at_host_usage``, the next prompt (arrival
order) does not fit the pages left, no prompt waits, or every sequence seat (``max_num_seqs``)
is held; partial prefills finish first (no new admissions) and no step may be in flight.

Decode phase: decode steps with continuous batching (on the decode gear); sequences are
on-boarded from the host store as device blocks free (up to ``prefetch_max_sequences`` a
step). A decode step whose sequences need more new blocks than are free parks the youngest in
the host store instead of letting the scheduler preempt them. The phase ends when the host
usage has fallen to ``switch_to_prefill_at_host_usage``, prompts wait, a sequence seat is free
for them, and parking the sequences still decoding would cost the next prefill phase no prompt
(else it would end sooner and a later phase, two more switches, would take what it leaves).
Those sequences keep their device blocks through the prefill phase (keep.py): the device KV is
block-major (rank_hook.DeviceKV), so block b of one gear shares memory with block b of the other
only, and the prefill gear never touches a block it was not given. They are parked in the host
store only when the prefill phase needs their blocks (the next prompt does not fit the free
ones), youngest first, and otherwise decode again in the next decode phase with no copy.

Prefix cache: the block manager's hash namespace (``view``) is the gear whose view the next
steps write, so a prompt hits only blocks written in the current gear's view; cached blocks of
the other gear keep their entries through a switch (no reset) until their slots are reused.

Host usage counts the pages of sequences whose KV lives only on the host. A swapped-in sequence
keeps its pages until its first decode step has come back (then every rank has read them).

Swap-in (§5.2): with ``async_swap`` the plan that on-boards a sequence only starts its copies;
the sequence waits in the swap-in queue (readiness.py), neither scheduled nor preempted, while
the resident sequences keep decoding, and decodes from the first plan after every rank has
reported it copied. With nothing else to run the leader waits for the reports, sending a plan
without tokens now and then so that a rank that died shows in that plan's broadcast. Without
``async_swap`` the copies run before the forward of the very plan that on-boards the sequence.

Swap-in overlaps prefill too (§5.2, Fig. 8): once the prefill phase has decided to end but its
last steps still run (partial prefills finishing, micro-batches in flight), host sequences are
on-boarded for the decode phase into decode-gear blocks whose memory no block the prefill gear
still uses shares on any rank (overlap.py; the partial prefills' remaining blocks are reserved
first, and no prompt is admitted any more). They stay held until the switch; the readiness board
alone says when they may decode (no barrier, no wait at the switch).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gearshift.worker.engine.contract import QueueView, StepKind, StepRequest
from gearshift.worker.engine.sequence import Sequence, SequenceStatus
from gearshift.worker.policies.seesaw.keep import KeptSequences
from gearshift.worker.policies.seesaw.overlap import GearOverlap
from gearshift.worker.policies.seesaw.pages import PageAllocator
from gearshift.worker.policies.seesaw.readiness import ReadinessBoard, SwapInQueue

if TYPE_CHECKING:
    from gearshift.worker.engine.scheduler import Scheduler
    from gearshift.worker.kv.block_manager import BlockManager

PREFILL_GEAR, DECODE_GEAR = 0, 1
# The plan sections this leader writes and every rank's hook (rank_hook.py) acts on.
SWAP_OUT = "seesaw.swap_out"  # pairs (host page, device block), gear of the previous plan
# Swap-outs of sequences kept on the device from another gear's view: that gear, then pairs.
SWAP_OUT_KEPT = "seesaw.swap_out_kept"
SWAP_IN = "seesaw.swap_in"  # the ticket, then pairs (host page, device block), gear of this plan
# The gear whose view a plan's swap-ins write, when not the plan's own (overlapping prefill).
SWAP_IN_GEAR = "seesaw.swap_in_gear"
AWAIT = "seesaw.await"  # no values: the leader waits for swap-ins (the plan proves ranks live)
# The number of the swap-outs up to this plan's (readiness.py): reported once written, waited
# for before a swap-in reads pages.
OUT_NUMBER = "seesaw.out_number"
# How long the leader sleeps on the board, with nothing else to run, before it sends a plan
# without tokens (which fails if a rank died); and how long an abort waits for the copies of a
# sequence being swapped in before leaving its blocks to a later step.
AWAIT_SLICE_S = 0.05
RETIRE_WAIT_S = 0.5


class Phase(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class Transition:
    """One entry of the event log: a switch of phase and why."""

    launch: int  # the engine's step launches so far
    to: Phase
    host_usage: float  # at the moment of the decision
    reason: str
    at: float  # time.monotonic()
    plan: int = -1  # the index of the first plan on the new gear


@dataclass(frozen=True)
class Thresholds:
    to_decode: float
    to_prefill: float
    prefetch_max: int


class SeesawLeader:
    """Phases, host pages and the swaps each plan carries."""

    def __init__(
        self,
        pages: PageAllocator,
        block_size: int,
        pipeline_depths: tuple[int, int],
        thresholds: Callable[[], Thresholds],
        page_bytes: int,
        board: ReadinessBoard,
        async_swap: bool = False,
        overlap: GearOverlap | None = None,
    ) -> None:
        self.pages = pages
        self.block_size = block_size
        self.depths = pipeline_depths
        self.thresholds = thresholds  # live: read at every decision
        self.page_bytes = page_bytes
        self.async_swap = async_swap
        self.overlap = overlap  # None: no swap-in while the prefill gear runs
        self.early: dict[str, Sequence] = {}  # swapped in during prefill, held until the switch
        # Why the prefill phase ends and the host usage then: fixed once early swap-ins started
        # (they leave the store, so the usage the decision saw is logged, not the one after).
        self._ending: tuple[str, float] | None = None
        self._in_gear: int | None = None  # this plan's swap-ins write another gear's view
        self.early_swap_ins = 0  # sequences on-boarded while the prefill gear still ran
        self.queue = SwapInQueue(board, self._release_blocks, pages.give_back)
        self.plans = 0  # plans submitted (the index of the next one)
        self.outs = 0  # plans submitted with swap-outs (the board numbers them from 1)
        self._stuck_at = -1  # the board's value when an abort's wait last timed out
        self.stall_seconds = 0.0  # the engine had nothing to run but sequences being copied in
        self._ticket = 0  # of this plan's swap-ins
        self._await = False  # this plan carries no work: it only checks that every rank lives
        self.phase = Phase.PREFILL
        self.transitions: list[Transition] = []
        self.launches = 0
        self.on_host: dict[str, Sequence] = {}  # KV only in the host store
        self.draining: dict[str, tuple[Sequence, int]] = {}  # swapped in; pages kept until
        self._out: list[int] = []  # (page, block) pairs of this step's swap-outs
        self._out_kept: list[int] = []  # pairs of kept sequences, read from the decode view
        self.kept = KeptSequences()  # decoding, held on the device through a prefill phase
        self._in: list[int] = []
        self._to_free: list[Sequence] = []
        self._switched = False
        self.swap_out_bytes = 0
        self.swap_in_bytes = 0
        self.parked = 0  # decoding sequences parked in the decode phase, not preempted
        self.scheduler: Scheduler | None = None
        self.blocks: BlockManager | None = None

    def bind(self, scheduler: Scheduler, blocks: BlockManager) -> None:
        self.scheduler, self.blocks = scheduler, blocks
        if self.overlap is not None:
            self.overlap.num_blocks = blocks.num_blocks
        scheduler.on_finish.append(self.forget)

    def _release_blocks(self, block_ids: list[int]) -> None:
        assert self.blocks is not None
        self.blocks.release(block_ids)

    @property
    def pending(self) -> tuple[int, int, bool]:
        """(blocks to the host, blocks from it, whether it re-shards) of the plan being built:
        what the simulator (operator/sim/seesaw_sim.py) prices a step by."""
        return (len(self._out) + len(self._out_kept)) // 2, len(self._in) // 2, self._switched

    @property
    def host_usage(self) -> float:
        held = sum(len(self.pages.held.get(r, ())) for r in self.on_host)
        return held / self.pages.num_pages if self.pages.num_pages else 1.0

    def forget(self, seq: Sequence) -> None:
        """A sequence ended (finished, aborted, failed): its host pages are free."""
        rid = seq.request_id
        self.on_host.pop(rid, None)
        self.draining.pop(rid, None)
        self.early.pop(rid, None)
        self.kept.forget(rid)
        if rid in self.queue:
            # Ranks may still write its blocks and read its pages: both wait for the copies.
            self.queue.retire(rid, self.pages.detach(rid))
            # Copies take milliseconds: wait, unless a wait already timed out with the board
            # standing still since (a dead rank: failing every request must not take minutes).
            stuck = self.queue.board.finished() == self._stuck_at
            if not stuck and not self.queue.wait(RETIRE_WAIT_S):
                self._stuck_at = self.queue.board.finished()
            self.queue.collect(self.plans)
            return
        self.pages.release(rid)

    # ---- the engine's calls, in order: step_request, held, plan_sections, step_submitted ----

    def step_request(self, queues: QueueView) -> StepRequest:
        assert self.scheduler is not None
        self.launches += 1
        self.queue.collect(self.plans)  # resident on every rank: they may decode now
        self._release_drained()
        if self.phase is Phase.PREFILL:
            return self._prefill_step(queues)
        return self._decode_step(queues)

    def held(self) -> frozenset[str]:
        leaving = frozenset(s.request_id for s in self._to_free)
        held = frozenset(self.on_host) | leaving | frozenset(self.queue.pending)
        return held | set(self.early) | set(self.kept.seqs)

    def plan_sections(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        if self._out:
            out[SWAP_OUT] = list(self._out)
        if self._out_kept:
            out[SWAP_OUT_KEPT] = [DECODE_GEAR, *self._out_kept]
        if self._in:
            out[SWAP_IN] = [self._ticket, *self._in]
            if self._in_gear is not None:
                out[SWAP_IN_GEAR] = [self._in_gear]
        if self._out or self._out_kept or self._in:
            # Swap-outs are numbered (this plan's is outs + 1): ranks report theirs written on
            # the board, and a swap-in waits there for every swap-out up to this number.
            number = self.outs + (1 if self._out or self._out_kept else 0)
            out[OUT_NUMBER] = [number]
        if self._await:
            out[AWAIT] = []
        return out

    def step_submitted(self) -> None:
        assert self.blocks is not None
        outs = (len(self._out) + len(self._out_kept)) // 2
        self.swap_out_bytes += outs * self.page_bytes
        self.outs += 1 if outs else 0
        self.swap_in_bytes += len(self._in) // 2 * self.page_bytes
        if self._in and self.async_swap:
            self.queue.sent(self._ticket, self.plans)
        self.plans += 1
        self._await = False
        for seq in self._to_free:
            self.blocks.free_table(seq.blocks)  # cached blocks keep their gear's hashes
        self._out, self._in, self._to_free, self._switched = [], [], [], False
        self._out_kept = []
        self._in_gear = None

    # ---- phases ----------------------------------------------------------------------------

    def _resident(self) -> list[Sequence]:
        assert self.scheduler is not None
        busy = self.held()
        return [s for s in self.scheduler.running if s.request_id not in busy]

    def _swap_out(self, seq: Sequence, kept: bool = False) -> bool:
        """Queue ``seq``'s computed KV for the host store (``kept``: from the decode gear's
        view while the prefill gear runs); False if the store has no room."""
        self.pages.release(seq.request_id)  # its own pages of an earlier stay, if any
        self.draining.pop(seq.request_id, None)
        count = -(-seq.num_computed_tokens // self.block_size)
        got = self.pages.allocate(seq.request_id, count)
        if got is None:
            return False
        pairs = self._out_kept if kept else self._out
        for page, block in zip(got, seq.blocks.block_ids[:count], strict=True):
            pairs += [page, block]
        self.on_host[seq.request_id] = seq
        self._to_free.append(seq)
        return True

    def _switch(self, to: Phase, usage: float, reason: str) -> None:
        """Log the decision with the host usage it was made at (before this switch's swaps)."""
        now = time.monotonic()
        self.transitions.append(Transition(self.launches, to, usage, reason, now, self.plans))
        self.phase = to
        if to is Phase.DECODE:
            self.early.clear()  # decode with the others once the board has them
            self._ending = None
            self.kept.release_all()  # they decode again, in the view that holds their KV
        self._switched = True
        assert self.blocks is not None
        # Blocks the next steps write hash in the new gear's namespace: prefixes hit only blocks
        # written in its view; the old gear's cached blocks stay cached, unreachable until then.
        self.blocks.view = PREFILL_GEAR if to is Phase.PREFILL else DECODE_GEAR

    def _pages(self, seq: Sequence) -> int:
        """Host pages (= device blocks) ``seq``'s KV takes once its current tokens are computed."""
        return -(-seq.num_tokens // self.block_size)

    def _admission(self, prefilling: list[Sequence]) -> tuple[int, int]:
        """(host pages, device blocks) left for new prompts once the prompts being prefilled
        have all of theirs: a prompt is admitted only if its whole KV fits both, so no prefill
        is preempted for device blocks and none finds the host store full (recomputed)."""
        assert self.blocks is not None
        host = len(self.pages.free) - sum(self._pages(s) for s in prefilling)
        device = self.blocks.num_free_blocks - sum(
            max(0, self._pages(s) - len(s.blocks.block_ids)) for s in prefilling
        )
        return host, device

    def _prefill_step(self, queues: QueueView) -> StepRequest:
        assert self.scheduler is not None
        t = self.thresholds()
        full = False
        resident = self._resident()
        for seq in resident:
            if seq.num_tokens - seq.num_computed_tokens == 1 and not self._swap_out(seq):
                full = True  # never with admission by free pages (below); kept as a guard
                break
        partial = [s for s in self._resident() if s.num_tokens - s.num_computed_tokens > 1]
        waiting = len(self.scheduler.waiting)
        host, device = self._admission(partial)
        # The usage once the prompts being prefilled are in: their pages are already committed
        # (admission counted them), so a threshold below 1 is not overshot by them. (Sequences
        # kept on the device take no pages: without this the phase ran past the threshold.)
        committed = sum(self._pages(s) for s in partial) / max(1, self.pages.num_pages)
        usage = self.host_usage + committed
        reason = ""
        if self._ending is not None:
            # Sequences on-boarded for the decode phase hold blocks: admit no prompt.
            reason, usage = self._ending
        elif usage >= t.to_decode and usage > 0:
            reason = f"host usage {usage:.3f} >= {t.to_decode}"
        elif full:
            reason = "host store full"
        elif not waiting and not partial and (self.on_host or self._resident() or self.kept):
            reason = "no prompt waits"
        elif waiting and len(self.scheduler.running) >= self.scheduler.config.max_num_seqs:
            # Sequences parked on the host still hold their seats: no waiting prompt can start
            # until some decode and finish (found by the simulator: the phase never ended).
            reason = f"all {self.scheduler.config.max_num_seqs} sequence seats taken"
        elif waiting and (need := self._pages(self.scheduler.waiting[0])) > host:
            # The next prompt (arrival order) does not fit what the store has left: the
            # store is as full as this trace lets it be (§4.2: switch when it is full).
            reason = f"next prompt needs {need} host pages, {max(0, host)} free"
        elif waiting and need > device and self.kept and not self._park_kept(need, host, device):
            reason = f"next prompt needs {need} device blocks, {max(0, device)} free"
        if not reason:
            pp = self.depths[PREFILL_GEAR]
            seats = -(-(len(partial) + waiting) // pp) if pp > 1 else None
            room = max(0, min(host, device))
            return StepRequest(StepKind.PREFILL, max_seqs=seats or None, admit_blocks=room)
        if partial:  # finish started prompts, admit no new one
            self._swap_in_early(t.prefetch_max, partial, (reason, usage))
            return StepRequest(StepKind.PREFILL, max_seqs=len(partial), admit_blocks=0)
        if queues.in_flight:
            self._swap_in_early(t.prefetch_max, partial, (reason, usage))
            return StepRequest(StepKind.NONE)
        for seq in self._resident():
            if seq.num_tokens - seq.num_computed_tokens == 1:
                self.scheduler.preempt(seq)  # no room on the host: recompute it later
        self._switch(Phase.DECODE, usage, reason)
        return self._decode_step(queues)

    def _park_kept(self, need: int, host: int, device: int) -> bool:
        """The next prompt needs ``need`` device blocks, more than the ``device`` free: park
        the youngest kept sequences whose blocks make room (their blocks free with this plan,
        the prompt is admitted by the next). False if that cannot let it in (keep.py)."""
        assert self.blocks is not None
        refs = self.blocks.ref_counts
        own = [sum(1 for b in s.blocks.block_ids if refs[b] == 1) for s in self.kept.seqs.values()]
        plan = self.kept.plan_parking(need, device, host, self.block_size, own)
        if not plan.enough:
            return False
        for seq in plan.victims:
            if not self._swap_out(seq, kept=True):
                return False  # never: the plan counted the pages; the phase ends (a guard)
            self.kept.forget(seq.request_id)
            self.kept.parked += 1
        return True

    def _keep_decoding(self) -> None:
        """At the switch to prefill: the sequences decoding now keep their device blocks (and
        give back the pages of their last stay on the host: every rank has read them, as no
        swap-in is outstanding and no step is in flight)."""
        resident = self._resident()
        for seq in resident:
            self.draining.pop(seq.request_id, None)
            self.pages.release(seq.request_id)
        self.kept.keep(resident)

    def _decode_step(self, queues: QueueView) -> StepRequest:
        assert self.scheduler is not None and self.blocks is not None
        t = self.thresholds()
        waiting = len(self.scheduler.waiting)
        usage = self.host_usage
        # Parked sequences keep their seats: with every seat taken no waiting prompt could start,
        # so a prefill phase would only park and switch back (with async swaps, before the
        # sequences just swapped in had decoded once, over and over). Decode frees seats.
        seat = len(self.scheduler.running) < self.scheduler.config.max_num_seqs
        if (
            waiting
            and seat
            and usage <= t.to_prefill
            and self._parked_usage() < t.to_decode
            and self._parking_is_free(t)
        ):
            if queues.in_flight or self.queue.busy:
                return self._wait(queues)  # no copy may run into the next gear's view
            self._keep_decoding()
            self._switch(
                Phase.PREFILL, usage, f"host usage {usage:.3f} <= {t.to_prefill}, prompts wait"
            )
            return self._prefill_step(queues)
        if not self._park_for_growth(queues):
            return StepRequest(StepKind.NONE)  # let the steps in flight finish first
        self._swap_in(t.prefetch_max)
        if not self._in and self.queue and not self._resident():
            return self._wait(queues)
        pp = self.depths[DECODE_GEAR]
        if pp > 1:
            return StepRequest(StepKind.DECODE, max_seqs=max(1, -(-len(self._resident()) // pp)))
        return StepRequest(StepKind.DECODE)

    def _wait(self, queues: QueueView) -> StepRequest:
        """Nothing to run until swap-ins are reported: wait for the board a little, then (if
        still nothing) send a plan without tokens, whose broadcast fails if a rank is gone."""
        if queues.in_flight:
            return StepRequest(StepKind.NONE)
        start = time.monotonic()
        if not self.queue.wait(AWAIT_SLICE_S):
            self._await = True
        self.stall_seconds += time.monotonic() - start
        return StepRequest(StepKind.NONE)

    def _park_for_growth(self, queues: QueueView) -> bool:
        """Decoding sequences whose next token opens a block, more of them than free blocks:
        park the youngest in the host store (their blocks free with this plan) rather than let
        the scheduler preempt them (recompute). False: wait for the steps in flight first."""
        assert self.blocks is not None and self.scheduler is not None
        decoding = [s for s in self._resident() if s.num_tokens - s.num_computed_tokens == 1]
        grows = [s for s in decoding if self._pages(s) > len(s.blocks.block_ids)]
        need = len(grows)
        if need <= self.blocks.num_free_blocks:
            return True
        if queues.in_flight:
            return False  # a sequence in flight may not move: its step still writes its KV
        while decoding and need > self.blocks.num_free_blocks:
            victim = decoding.pop()
            if not self._swap_out(victim):
                break  # the store is full too: the scheduler preempts (counted)
            self.parked += 1
            need -= victim in grows
        return True

    def _parking_is_free(self, t: Thresholds) -> bool:
        """Switch while sequences still decode only where parking all of them would cost the
        next prefill phase no prompt: they are kept on the device, but the phase may need their
        blocks (keep.py), and their pages would then shrink it, so that a later phase (two more
        switches) would take the prompts it leaves. Until then decoding goes on and they finish."""
        assert self.scheduler is not None
        held = sum(len(self.pages.held.get(r, ())) for r in self.on_host)
        parked = sum(-(-s.num_computed_tokens // self.block_size) for s in self._resident())
        alone = self._admits(held, t)
        return alone > 0 and self._admits(held + parked, t) == alone

    def _admits(self, used: int, t: Thresholds) -> int:
        """Waiting prompts (arrival order) a prefill phase that starts with ``used`` host pages
        takes before the store is full or reaches switch_to_decode_at_host_usage."""
        assert self.scheduler is not None
        total, n = self.pages.num_pages, 0
        for seq in self.scheduler.waiting:
            pages = self._pages(seq)
            if (used > 0 and used >= t.to_decode * total) or used + pages > total:
                break
            used, n = used + pages, n + 1
        return n

    def _parked_usage(self) -> float:
        """Host usage once the sequences decoding now are parked there: switching to prefill
        while that reaches switch_to_decode_at_host_usage would switch straight back."""
        pages = sum(len(self.pages.held.get(r, ())) for r in self.on_host)
        pages += sum(-(-s.num_tokens // self.block_size) for s in self._resident())
        return pages / self.pages.num_pages if self.pages.num_pages else 1.0

    def _swap_in(self, limit: int) -> None:
        """On-board host sequences, oldest first, while device blocks are free (§4.2)."""
        assert self.blocks is not None
        leaving = {s.request_id for s in self._to_free}  # its blocks free after this plan
        ready = [(r, s) for r, s in self.on_host.items() if r not in leaving]
        decoding = len(self._resident())
        ticket = self.queue.next_ticket
        for rid, seq in ready[:limit]:
            # Room for the KV it has and the token its next decode step writes, leaving a block
            # per decoding sequence free: on-boarding must not cause preemptions (recomputes).
            need = self.blocks.blocks_needed(seq.num_tokens)
            if self.blocks.num_free_blocks - need < decoding + 1:
                break
            if not self.blocks.allocate(seq.blocks, seq.num_tokens):
                break
            decoding += 1
            self._on_board(rid, seq, ticket)
        if self._in:
            self._ticket = ticket
            self.queue.next_ticket += 1

    def _on_board(self, rid: str, seq: Sequence, ticket: int) -> None:
        """Copy ``seq``'s pages into the device blocks it was just given, with this plan."""
        assert self.blocks is not None
        pages = self.pages.held[rid]
        for page, block in zip(pages, seq.blocks.block_ids, strict=False):
            self._in += [page, block]
        del self.on_host[rid]
        self.draining[rid] = (seq, seq.num_computed_tokens)
        if self.async_swap:
            # Until every rank reports the copies, the queue holds a reference to the blocks.
            self.blocks.retain(seq.blocks.block_ids)
            self.queue.add(rid, ticket, seq.blocks.block_ids)

    def _swap_in_early(
        self, limit: int, partial: list[Sequence], ending: tuple[str, float]
    ) -> None:
        """§5.2, Fig. 8 (swap-in overlaps prefill): the phase ends (``ending``: why, at what
        host usage) but its last steps still run; on-board host sequences, oldest first, into
        decode-gear blocks sharing no memory with any block the prefill gear still uses
        (overlap.py). They decode after the switch, once every rank reported them."""
        if not self.async_swap or self.overlap is None or not self.on_host:
            return
        assert self.blocks is not None and self.scheduler is not None
        # The partial prefills' remaining blocks, now: the prefill gear touches no other block
        # before the switch (no prompt is admitted from here on). Admission left them free.
        for seq in partial:
            if not self.blocks.allocate(seq.blocks, seq.num_tokens):
                return
        busy = {
            b
            for s in self.scheduler.running
            if s.request_id not in self.early
            for b in s.blocks.block_ids
        }
        overlap = self.overlap

        def apart(block: int) -> bool:
            return not overlap.clashes(block) & busy

        leaving = {s.request_id for s in self._to_free}  # swapped out by this very plan
        ticket = self.queue.next_ticket
        taken = 0
        for rid, seq in list(self.on_host.items()):
            if taken >= limit:
                break
            if rid in leaving:
                continue
            # As in the decode phase: a block per sequence that will decode stays free.
            need = self.blocks.blocks_needed(seq.num_tokens)
            if self.blocks.num_free_blocks - need < len(self.early) + len(self.kept) + 1:
                break
            if not self.blocks.allocate_where(seq.blocks, seq.num_tokens, apart):
                break
            self._on_board(rid, seq, ticket)
            self.early[rid] = seq
            self._ending = ending
            self.early_swap_ins += 1
            taken += 1
        if self._in:
            self._ticket = ticket
            self.queue.next_ticket += 1
            self._in_gear = DECODE_GEAR

    def _release_drained(self) -> None:
        """Pages of swapped-in sequences whose first decode came back (every rank read them),
        or that were preempted meanwhile."""
        for rid, (seq, at) in list(self.draining.items()):
            if seq.num_computed_tokens > at or seq.status is not SequenceStatus.RUNNING:
                del self.draining[rid]
                self.pages.release(rid)
