"""What a Seesaw rank does before each plan: KV swaps named by the plan, and a re-shard when the
plan's gear is not the active one (§4.1, §4.2).

The device KV cache is one buffer per rank that each gear views its own way: the prefill gear
as its stage's layers x its heads, the decode gear as its own, both block-major (DeviceKV), so
a block id is the same memory in both views. A gear only reads blocks the leader gave it in its
own view: sequences decoding keep their blocks (in the decode view) through a prefill phase, and
the decode gear's view may already hold swap-ins into blocks that the prefill gear does not use
(overlap.py). Order inside one plan: swap-outs (from the view of the gear that ran the previous
plan; those of kept sequences from the decode view), the switch, then swap-ins (into the new
gear's view).

With ``async_swap`` a swap-in is not waited for: the prefetcher thread copies this rank's shard
while the main thread runs the plans that follow (decode steps of resident sequences), then
reports the plan's ticket on the readiness board; the leader schedules those sequences only
once every rank has (readiness.py, §5.2). A swap-in reads pages other ranks wrote: it waits on
the board until every rank has written the swap-outs before it (no barrier of the group). A swap-in
may write the next gear's view while the prefill gear still runs (swap-in overlapping prefill):
the leader chose blocks whose memory the running gear no longer touches (overlap.py), so a
switch to that gear does not wait for those copies either.

On a GPU, device -> pinned staging copies run on a copy stream of their own, and the writer
thread waits for each one's event before it moves the rows on into the shared store.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from gearshift.worker.engine.model_runner import ModelRunner
from gearshift.worker.engine.plan import StepPlan
from gearshift.worker.kv.cache import LayerKV, zeroed
from gearshift.worker.policies.seesaw.async_copy import CopyWorker, Staging
from gearshift.worker.policies.seesaw.host_kv import HostKVStore
from gearshift.worker.policies.seesaw.leader import (
    OUT_NUMBER,
    SWAP_IN,
    SWAP_IN_GEAR,
    SWAP_OUT,
    SWAP_OUT_KEPT,
)
from gearshift.worker.policies.seesaw.readiness import ReadinessBoard
from gearshift.worker.policies.seesaw.weights import WeightSet

log = logging.getLogger(__name__)

HOLD_LIMIT_S = 5.0  # the longest a report waits for ``hold_plans`` (tests only)
WRITTEN_WAIT_S = 60.0  # a swap-in waits this long at most for other ranks' swap-outs


@dataclass(frozen=True)
class GearKV:
    """Which part of a sequence's KV one gear keeps on this rank."""

    layers: range  # global decoder layers
    heads: range  # global KV heads
    writer: bool  # the one replica of these heads that writes them to the host store


class DeviceKV:
    """One buffer of ``num_blocks`` slabs; gear g views block b as [layers][k, v] of
    [heads, block_size, D] at the start of slab b (per layer: [blocks, heads, block_size, D]
    with a block stride of one slab).

    Block-major, so that a block id means the same memory to both gears (overlap.py): block b of
    one gear overlaps block b of the other and no other. A sequence's blocks then stay valid in
    the view that wrote them while the other gear runs on other blocks (kept through a prefill
    phase, keep.py), and a freed block keeps the prefix-cache entry of the view that wrote it
    (the block manager's hash namespace) until it is handed out again. Attention kernels take the
    block stride (torch reference, Triton, the C++ CPU kernels: each block contiguous inside).
    """

    def __init__(
        self,
        gears: list[GearKV],
        num_blocks: int,
        block_size: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        unit = block_size * head_dim  # one head's block
        slab = max(2 * len(g.layers) * len(g.heads) for g in gears) * unit
        self.slab = slab  # elements per block id
        self.buffer = zeroed((num_blocks * slab,), dtype, device)
        slabs = self.buffer.view(num_blocks, slab)
        self.views: list[list[LayerKV]] = []
        for g in gears:
            used = 2 * len(g.layers) * len(g.heads) * unit
            v = slabs[:, :used].view(
                num_blocks, len(g.layers), 2, len(g.heads), block_size, head_dim
            )
            self.views.append([(v[:, i, 0], v[:, i, 1]) for i in range(len(g.layers))])


@dataclass
class SwapCounters:
    """What this rank moved (the leader's figures are the group's stats)."""

    bytes_out: int = 0
    bytes_in: int = 0
    seconds: float = 0.0
    sync_in_seconds: float = 0.0  # synchronous swap-ins: the plans carrying them waited this long
    reshards: list[float] = field(default_factory=list)
    out_barrier_seconds: float = 0.0  # synchronous swap-outs: waiting for every rank first


class SeesawRankHook:
    """The policy's work on one rank before each plan (engine/model_runner.RankHook)."""

    def __init__(
        self,
        weights: WeightSet,
        kv: DeviceKV,
        gears: list[GearKV],
        store: HostKVStore,
        barrier: Callable[[], None],
        rank: int = 0,
        async_swap: bool = False,
        staging_bytes: int = 0,
        hold_plans: int = 0,
    ) -> None:
        self.rank = rank
        self.board: ReadinessBoard = store.board
        self.barrier = barrier  # every rank of the group, in plan order
        self.weights = weights
        self.kv = kv
        self.gears = gears
        self.store = store
        self.active = weights.active if weights.active is not None else 0
        self.counters = SwapCounters()
        self.async_swap = async_swap
        self.writer: CopyWorker | None = None
        self.prefetcher: CopyWorker | None = None
        self.copy_stream: torch.cuda.Stream | None = None  # GPU: device -> staging copies
        self.prefetch_gears: set[int] = set()  # views that submitted swap-ins write
        if async_swap:
            pin = weights.device.type == "cuda"
            self.staging = Staging(staging_bytes, pin)
            self.writer = CopyWorker("seesaw-swap-out")
            self.prefetcher = CopyWorker("seesaw-prefetch")
        # Tests only: a report waits until this rank has begun ``hold_plans`` more plans (at
        # most HOLD_LIMIT_S), so plans provably run while a swap-in is outstanding.
        self.hold_plans = hold_plans
        self.plans_begun = 0
        self._begun = threading.Condition()
        self._closing = False

    @staticmethod
    def _pairs(values: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        if values is None or values.numel() == 0:
            return None
        pairs = values.view(-1, 2)
        return pairs[:, 0].contiguous(), pairs[:, 1].contiguous()

    def before_step(self, runner: ModelRunner, plan: StepPlan) -> None:
        start = time.perf_counter()
        with self._begun:
            self.plans_begun += 1
            self._begun.notify_all()
        numbered = plan.section(OUT_NUMBER)
        number = int(numbered[0]) if numbered is not None else 0
        out = self._pairs(plan.section(SWAP_OUT))
        kept_section = plan.section(SWAP_OUT_KEPT)
        kept = self._pairs(kept_section[1:]) if kept_section is not None else None
        if out is not None or kept is not None:
            if self.prefetcher is None:
                # A page may be written again once its sequence ended (even mid swap-in): no
                # rank may still be reading it from an earlier plan. (Asynchronously, the
                # leader frees such pages only once every rank reported the swap-in done.)
                waited = time.perf_counter()
                self.barrier()
                self.counters.out_barrier_seconds += time.perf_counter() - waited
            if out is not None and self.gears[self.active].writer:
                self._swap_out(out[0], out[1], self.active)
            if kept is not None and kept_section is not None:
                gear = int(kept_section[0])  # the view that holds them (not the running gear's)
                if self.gears[gear].writer:
                    self._swap_out(kept[0], kept[1], gear)
            self._written(number)
        if plan.gear != self.active:
            if self.prefetcher is not None and self.prefetch_gears - {plan.gear}:
                # A copy into the old gear's view must end before the next gear views that
                # memory its own way (the leader switches only once they were reported: this
                # returns at once). Copies into the next gear's view go on (overlap.py).
                self.prefetcher.join()
                self.prefetch_gears.clear()
            runner.flush()  # no pipeline send of the old gear may still read its weights
            self.counters.reshards.append(self.weights.activate(plan.gear).seconds)
            self.active = plan.gear
            runner.kv_caches = self.kv.views[plan.gear]
        section = plan.section(SWAP_IN)
        swap_in = self._pairs(section[1:]) if section is not None else None
        if section is not None and swap_in is not None:
            target = plan.section(SWAP_IN_GEAR)
            gear = int(target[0]) if target is not None else plan.gear
            self._swap_in(int(section[0]), number, swap_in[0], swap_in[1], gear)
        if out is not None or kept is not None or swap_in is not None:
            self.counters.seconds += time.perf_counter() - start

    def _written(self, number: int) -> None:
        """Report swap-out ``number`` written (after this rank's writes of it, if any)."""
        report = partial(self.board.wrote_out, self.rank, number)
        if self.writer is None:
            report()
        else:
            self.writer.submit(report)

    def _await_written(self, number: int) -> None:
        if not self.board.wait_written(number, WRITTEN_WAIT_S):
            raise RuntimeError(
                f"seesaw rank {self.rank}: a rank never wrote swap-out {number} within "
                f"{WRITTEN_WAIT_S:.0f} s (board {self.board.written()})"
            )

    def _stage(self, staged: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event | None:
        """Copy ``src`` into pinned ``staged``; on a GPU asynchronously, on the copy stream
        (after what compute's stream queued for ``src``), returning the copy's event."""
        if src.device.type != "cuda":
            staged.copy_(src)
            return None
        if self.copy_stream is None:
            self.copy_stream = torch.cuda.Stream(src.device)
        stream = self.copy_stream
        stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(stream):
            staged.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        src.record_stream(stream)  # its memory is not reused before the copy has read it
        return done

    def _write_staged(
        self, done: torch.cuda.Event | None, pages: torch.Tensor, layer: int, kv: int,
        heads: range, staged: torch.Tensor,
    ) -> None:  # fmt: skip
        if done is not None:
            done.synchronize()  # the writer thread waits, not compute
        self.store.write_part(pages, layer, kv, heads, staged)

    def _swap_out(self, pages: torch.Tensor, blocks: torch.Tensor, gear: int) -> None:
        g, views = self.gears[gear], self.kv.views[gear]
        if self.writer is None:
            self.counters.bytes_out += self.store.write_shard(
                pages, blocks, views, g.layers, g.heads
            )
            return
        # device -> staging now (the blocks free after this plan), staging -> shared later.
        for local, layer in enumerate(g.layers):
            for kv in (0, 1):
                src = views[local][kv].index_select(0, blocks.to(views[local][kv].device))
                staged = self.staging.take(src)
                if staged is None:
                    self.writer.join()
                    self.staging.reset()
                    staged = self.staging.take(src)
                if staged is None:  # larger than the whole staging buffer: straight through
                    self.store.write_part(pages, layer, kv, g.heads, src)
                    continue
                done = self._stage(staged, src)
                self.writer.submit(
                    partial(self._write_staged, done, pages, layer, kv, g.heads, staged)
                )
                self.counters.bytes_out += src.numel() * src.element_size()

    def _swap_in(
        self, ticket: int, number: int, pages: torch.Tensor, blocks: torch.Tensor, gear: int
    ) -> None:
        if self.writer is not None:
            self.writer.join()  # this rank's own swap-outs are in the store
            self.staging.reset()
        if gear != self.active and self.prefetcher is None:
            raise RuntimeError(f"seesaw rank {self.rank}: a synchronous swap-in into gear {gear}")
        g, views = self.gears[gear], self.kv.views[gear]
        read = partial(self.store.read_shard, pages, blocks, views, g.layers, g.heads)
        if self.prefetcher is None:
            start = time.perf_counter()
            self._await_written(number)  # pages other ranks' swap-outs wrote
            self.counters.bytes_in += read()
            self.counters.sync_in_seconds += time.perf_counter() - start
            self.board.report(self.rank, ticket)
            return
        block = views[0][0][0]  # one block of one layer's keys on this rank
        self.counters.bytes_in += (
            len(blocks) * len(g.layers) * 2 * block.numel() * block.element_size()
        )
        device = block.device
        until = self.plans_begun + self.hold_plans
        self.prefetch_gears.add(gear)
        queued = None
        if device.type == "cuda":
            # After what compute's stream has queued so far (steps that last used these blocks);
            # not after the steps that follow, which the copies overlap.
            queued = torch.cuda.Event()
            queued.record(torch.cuda.current_stream(device))

        def prefetch() -> None:
            self._await_written(number)  # pages other ranks' swap-outs wrote
            if device.type == "cuda":
                # A stream of its own: the copies overlap the main thread's kernels, and are
                # complete (synchronize) before the report lets the leader schedule them.
                stream = torch.cuda.Stream(device)
                assert queued is not None
                stream.wait_event(queued)
                with torch.cuda.stream(stream):
                    read()
                stream.synchronize()
            else:
                read()
            if self.hold_plans:
                with self._begun:
                    self._begun.wait_for(
                        lambda: self.plans_begun >= until or self._closing, HOLD_LIMIT_S
                    )
            self.board.report(self.rank, ticket)

        self.prefetcher.submit(prefetch)

    def close(self) -> None:
        with self._begun:
            self._closing = True
            self._begun.notify_all()
        for worker in (self.writer, self.prefetcher):
            if worker is not None:
                worker.close()
        self.store.close()
