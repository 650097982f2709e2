"""Seesaw (MLSys 2025): a pipeline-heavy prefill gear and a tensor-heavy decode gear over the same
ranks, re-sharded from host copies (§4.1), with prefilled KV parked in a host store shared by the
node's ranks (§4.2) and transitions only when that store is full or drained (Fig. 6).

Any pair of layouts of the same world size works, in either direction (the paper's artifact
needs prefill PP >= decode PP); both gears may be pipelined only if their last stages start at
the same rank (where the leader receives the logits from).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from gearshift.v1 import policy_pb2
from gearshift.worker.engine.contract import QueueView, SectionValues, StepRequest
from gearshift.worker.engine.device_memory import DeviceLedger
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.model.config import ModelConfig
from gearshift.worker.parallel.groups import create_groups
from gearshift.worker.parallel.layout import Layout, stage_layers
from gearshift.worker.parallel.pipeline import logits_channel
from gearshift.worker.policies.base import Policy, RankContext, RankModel
from gearshift.worker.policies.gears import build_gear, pipeline_stage
from gearshift.worker.policies.seesaw.host_kv import (
    SHM_DIR,
    STORE_ADDRESS,
    HostKVStore,
    PageShape,
    StoreAddress,
    check_address,
    group_tag,
)
from gearshift.worker.policies.seesaw.leader import (
    DECODE_GEAR,
    PREFILL_GEAR,
    Phase,
    SeesawLeader,
    Thresholds,
)
from gearshift.worker.policies.seesaw.overlap import GearOverlap, ViewShape
from gearshift.worker.policies.seesaw.pages import PageAllocator
from gearshift.worker.policies.seesaw.rank_hook import DeviceKV, GearKV, SeesawRankHook
from gearshift.worker.policies.seesaw.weights import WeightSet
from gearshift.worker.typed_collectives import broadcast_message

if TYPE_CHECKING:
    from gearshift.worker.engine.scheduler import ScheduledBatch, Scheduler
    from gearshift.worker.kv.block_manager import BlockManager

log = logging.getLogger(__name__)

GEARS = ("prefill", "decode")
# Tests only: each rank's prefetcher reports a swap-in done only once the rank has begun this
# many more plans (at most rank_hook.HOLD_LIMIT_S), so overlap shows in the plan order.
PREFETCH_HOLD_ENV = "GEARSHIFT_SEESAW_PREFETCH_HOLD"


def memory_limit() -> int:
    """The pod's memory limit (cgroup v2), else this host's physical memory."""
    try:
        raw = open("/sys/fs/cgroup/memory.max").read().strip()  # noqa: SIM115
        if raw != "max":
            return int(raw)
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _activate(weights: WeightSet, gear: int) -> None:
    """A start-up switch of the working set (graph capture): no transition, not recorded."""
    weights.activate(gear, record=False)


class SeesawPolicy(Policy):
    """Prefill gear c_p = (tp, pp) and decode gear c_d = (tp, pp) over the same ranks."""

    kind = "seesaw"

    def __init__(self, policy: policy_pb2.Policy, world_size: int) -> None:
        super().__init__(policy, world_size)
        m = self.message
        self.layouts = (
            Layout(tp=m.prefill.tp, pp=m.prefill.pp),
            Layout(tp=m.decode.tp, pp=m.decode.pp),
        )
        self.gear_names = GEARS
        # One rank for both gears: seesaw.spec refuses pipelines whose last stages differ.
        lasts = {(lay.pp - 1) * lay.stage_size for lay in self.layouts if lay.pp > 1}
        self.logits_rank = lasts.pop() if lasts else 0
        self.leader: SeesawLeader | None = None
        self.hook: SeesawRankHook | None = None
        self.weights: WeightSet | None = None
        self.ledger: DeviceLedger | None = None  # rank 0's (the process the leader runs in)

    def _thresholds(self) -> Thresholds:
        m = self.message
        return Thresholds(
            float(m.switch_to_decode_at_host_usage),
            float(m.switch_to_prefill_at_host_usage),
            int(m.prefetch_max_sequences),
        )

    def check_model(self, cfg: ModelConfig) -> None:
        for name, layout in zip(GEARS, self.layouts, strict=True):
            try:
                layout.check_model(cfg.num_heads, cfg.num_kv_heads, cfg.num_layers)
            except InvalidRequestError as exc:
                field = f"policy.seesaw.{name}" + (
                    f".{exc.field}" if exc.field in ("tp", "pp") else ""
                )
                raise InvalidRequestError(field, f"{field}: {exc.message}") from exc

    def host_capacity_bytes(self) -> int:
        m = self.message
        if m.HasField("host_kv_capacity_bytes") and m.host_kv_capacity_bytes > 0:
            return int(m.host_kv_capacity_bytes)
        wanted = int(memory_limit() * m.host_kv_capacity_fraction)
        shm = os.statvfs(SHM_DIR)
        return min(wanted, shm.f_bavail * shm.f_frsize)  # /dev/shm is the real ceiling

    # ---- every rank ------------------------------------------------------------------------

    def build_rank(self, ctx: RankContext) -> RankModel:
        cfg = ctx.spec.config
        self.check_model(cfg)
        gears, gear_kv = [], []
        # One logits channel for both gears: the leader receives from the one last stage.
        logits = None
        if any(layout.pp > 1 for layout in self.layouts):
            logits = logits_channel(self.world_size, ctx.rank, ctx.device, ctx.timeout)
        closers = [logits.close] if logits is not None else []
        # Each gear goes to host memory as soon as it is built: the device holds one shard at a
        # time, then the working set (weights.py), then the KV cache (sized after it).
        weights = WeightSet([], ctx.device, ctx.spec.packing)
        ledger = ctx.ledger
        for name, layout in zip(GEARS, self.layouts, strict=True):
            groups = create_groups(layout, ctx.rank, cfg.num_kv_heads, ctx.timeout)
            stage = pipeline_stage(layout, ctx, cfg.num_layers, groups.pp, logits)
            gear = build_gear(name, ctx, groups, groups.tp, False, stage)
            ledger.hold(f"{name} gear", [*gear.model.parameters(), *gear.model.buffers()])
            weights.add(gear.model)
            ledger.hold(f"{name} gear", gear.model.buffers())  # its rotary tables stay
            gears.append(gear)
            if stage is not None:
                closers.append(stage.close)
            n = layout.kv_heads_per_rank(cfg.num_kv_heads)
            h0 = layout.kv_head_start(ctx.rank, cfg.num_kv_heads)
            replicas = max(1, layout.stage_size // cfg.num_kv_heads)
            gear_kv.append(
                GearKV(
                    stage.layers if stage is not None else range(cfg.num_layers),
                    range(h0, h0 + n),
                    layout.head_block(ctx.rank) % replicas == 0,
                )
            )
        ledger.hold("seesaw working set", [weights.allocate()])
        weights.activate(PREFILL_GEAR)
        self.weights, self.ledger = weights, ledger
        page = PageShape(cfg.num_layers, cfg.num_kv_heads, ctx.block_size, cfg.head_dim,
                         ctx.spec.dtype)  # fmt: skip
        store = self._open_store(ctx, page)
        barrier_group = dist.new_group(backend="gloo") if self.world_size > 1 else None

        def barrier() -> None:
            if barrier_group is not None:
                dist.barrier(group=barrier_group)

        biggest = max(gear_kv, key=lambda g: len(g.layers) * len(g.heads))
        held = RankModel(
            gears=gears,
            kv_layers=len(biggest.layers),
            kv_heads=len(biggest.heads),
            logits_rank=self.logits_rank,
            logits_channel=logits,
            closers=closers,
        )

        def allocate(num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
            kv = DeviceKV(gear_kv, num_blocks, ctx.block_size, cfg.head_dim, ctx.spec.dtype,
                          ctx.device)  # fmt: skip
            m = self.message
            self.hook = SeesawRankHook(
                weights,
                kv,
                gear_kv,
                store,
                barrier,
                ctx.rank,
                m.async_swap,
                int(m.pinned_staging_bytes),
                int(os.environ.get(PREFETCH_HOLD_ENV, "0")),
            )
            held.hook = self.hook
            return kv.views[PREFILL_GEAR]

        held.kv_allocator = allocate
        # Decode-only steps of the decode gear may replay CUDA graphs; each gear's weights land
        # at the same addresses at every re-shard (WeightSet), and its KV views never move.
        held.graph_gears = (DECODE_GEAR,)
        held.activate_gear = partial(_activate, weights)
        held.gear_kv = self._gear_kv
        if ctx.rank == 0:
            self.leader = SeesawLeader(
                PageAllocator(store.num_pages),
                ctx.block_size,
                (self.layouts[0].pp, self.layouts[1].pp),
                self._thresholds,
                page.nbytes,
                store.board,
                self.message.async_swap,
                self._overlap(cfg),
            )
        return held

    def _overlap(self, cfg: ModelConfig) -> GearOverlap:
        """Each rank's (prefill view, decode view) of the device KV (rank_hook.DeviceKV)."""

        def view(layout: Layout, rank: int) -> ViewShape:
            layers = cfg.num_layers
            if layout.pp > 1:
                layers = len(stage_layers(cfg.num_layers, layout.pp, layout.stage(rank)))
            return ViewShape(layers, layout.kv_heads_per_rank(cfg.num_kv_heads))

        prefill, decode = self.layouts[PREFILL_GEAR], self.layouts[DECODE_GEAR]
        return GearOverlap([(view(prefill, r), view(decode, r)) for r in range(self.world_size)])

    def _gear_kv(self, gear: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        assert self.hook is not None, "the KV cache is allocated before graphs are captured"
        return self.hook.kv.views[gear]

    def _open_store(self, ctx: RankContext, page: PageShape) -> HostKVStore:
        """Rank 0 creates the segment; the others open it by the name it broadcasts."""
        address: StoreAddress | None = None
        if ctx.rank == 0:
            pages = self.host_capacity_bytes() // page.nbytes
            need = -(-ctx.spec.max_model_len // ctx.block_size)
            if pages < need:
                raise InvalidRequestError(
                    "policy.seesaw.host_kv_capacity_bytes",
                    f"policy.seesaw.host_kv_capacity_bytes: the host KV store holds {pages} pages "
                    f"of {ctx.block_size} tokens, less than one sequence of max_model_len "
                    f"({ctx.spec.max_model_len} tokens) needs ({need})",
                )
            store = HostKVStore.create(group_tag(), page, pages, self.world_size)
            address = StoreAddress(store.name, pages)
        if self.world_size > 1:
            address = broadcast_message(STORE_ADDRESS, address, 0, what="seesaw host KV store")
        if ctx.rank != 0:
            assert address is not None
            check_address(address, group_tag())
            store = HostKVStore(address.name, page, address.pages, False, self.world_size)
        if ctx.device.type == "cuda":
            store.pin()  # each rank its own mapping
        return store

    # ---- the leader ------------------------------------------------------------------------

    def _lead(self) -> SeesawLeader:
        assert self.leader is not None, "build_rank(rank 0) creates the leader's half"
        return self.leader

    def micro_batches(self) -> int:
        phase = self.leader.phase if self.leader is not None else Phase.PREFILL
        return self.layouts[PREFILL_GEAR if phase is Phase.PREFILL else DECODE_GEAR].pp

    def bind(self, scheduler: Scheduler, blocks: BlockManager) -> None:
        self._lead().bind(scheduler, blocks)

    def step_request(self, queues: QueueView) -> StepRequest:
        return self._lead().step_request(queues)

    def held(self) -> frozenset[str]:
        return self._lead().held()

    def plan_sections(self, batch: ScheduledBatch) -> Mapping[str, SectionValues]:
        del batch
        return self._lead().plan_sections()

    def step_submitted(self) -> None:
        self._lead().step_submitted()

    def choose_gear(self, batch: ScheduledBatch) -> int:
        del batch
        return PREFILL_GEAR if self._lead().phase is Phase.PREFILL else DECODE_GEAR

    def stats(self) -> dict[str, float]:
        if self.leader is None:
            return {}
        lead = self.leader
        reshard = sum(r.seconds for r in self.weights.history[1:]) if self.weights else 0.0
        if lead.async_swap:
            wait = lead.queue.wait_seconds  # summed over sequences, until every rank had them
        else:  # the steps that carried synchronous swap-ins waited for them this long
            wait = self.hook.counters.sync_in_seconds if self.hook is not None else 0.0
        return {
            "phase_decode": float(lead.phase is Phase.DECODE),
            "transitions": float(len(lead.transitions)),
            "reshard_seconds": reshard,
            "swap_out_bytes": float(lead.swap_out_bytes),
            "swap_in_bytes": float(lead.swap_in_bytes),
            "swap_wait_seconds": wait,
            "swap_waiting_sequences": float(len(lead.queue)),
            "swap_stall_seconds": lead.stall_seconds,
            "host_kv_usage": lead.host_usage,
            "parked_sequences": float(lead.parked),
            "early_swap_in_sequences": float(lead.early_swap_ins),
            # Decoding sequences kept on the device at switches to prefill, and those of them
            # parked to the host because the prefill phase needed their blocks (keep.py).
            "kept_sequences": float(lead.kept.kept),
            "kept_parked_sequences": float(lead.kept.parked),
        }
