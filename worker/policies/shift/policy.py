"""Shift Parallelism's two gears and per-step choice (Shift §3.3, Alg. 3).

Two gears share one KV cache: the base gear (Ulysses SP × TP) for large batches and the shift
gear (full TP over the same ranks) for small ones. A step whose scheduled token count, prefill
chunks included, exceeds the threshold runs the base gear; otherwise the shift gear.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from gearshift.v1 import policy_pb2
from gearshift.worker.model.config import ModelConfig
from gearshift.worker.parallel.groups import create_groups
from gearshift.worker.parallel.layout import Layout
from gearshift.worker.policies.base import Policy, RankContext, RankModel
from gearshift.worker.policies.gears import build_gear

if TYPE_CHECKING:
    from gearshift.worker.engine.scheduler import ScheduledBatch

log = logging.getLogger(__name__)

BASE, SHIFT = 0, 1
DEFAULT_THRESHOLD = 256


class ShiftPolicy(Policy):
    """Base gear (SP × TP) above ``threshold`` scheduled tokens, shift gear (TP = SP × TP) at or
    below it; ``threshold`` is live."""

    kind = "shift"

    def __init__(self, policy: policy_pb2.Policy, world_size: int) -> None:
        super().__init__(policy, world_size)
        self.layout = Layout(sp=self.message.sp, tp=self.message.tp)
        self.gear_names = ("base", "shift")

    @property
    def threshold(self) -> int:
        return int(self.message.threshold)

    def check_model(self, cfg: ModelConfig) -> None:
        self.layout.check_model(cfg.num_heads, cfg.num_kv_heads, cfg.num_layers)

    def build_rank(self, ctx: RankContext) -> RankModel:
        cfg = ctx.spec.config
        self.check_model(cfg)
        layout = self.layout
        groups = create_groups(layout, ctx.rank, cfg.num_kv_heads, ctx.timeout)
        base = build_gear("base", ctx, groups, groups.tp, layout.sp > 1)
        # Shift §3.3.2: a separate copy of the weights sharded over all ranks in SP_TP order, so
        # the shift gear owns the heads the base gear owns after its all-to-all (KV invariance).
        shift = build_gear("shift", ctx, groups, groups.sp_tp, False)
        base_bytes, shift_bytes = base.weight_bytes(), shift.weight_bytes()
        # Eq. (1): w_total = w/TP + w/(SP x TP).
        log.info(
            "shift policy weights on rank %d: base gear %.1f MiB (1/TP), shift gear %.1f MiB "
            "(1/(SPxTP)), total %.1f MiB",
            ctx.rank,
            base_bytes / 2**20,
            shift_bytes / 2**20,
            (base_bytes + shift_bytes) / 2**20,
        )
        return RankModel(
            gears=[base, shift],
            kv_layers=cfg.num_layers,
            kv_heads=layout.kv_heads_per_rank(cfg.num_kv_heads),
        )

    def collectives(self) -> tuple[str, ...]:
        # The shift gear is TP over every rank (§3.3.2): all-reduces even when the base is SP.
        base = self.layout.collectives()
        return base if "all_reduce" in base else ("all_reduce", *base)

    def choose_gear(self, batch: ScheduledBatch) -> int:
        return BASE if batch.num_tokens > self.threshold else SHIFT

    def pad_multiple(self, gear: int) -> int:
        # Only the base gear splits tokens over SP ranks (§3.2: pad to a multiple of SP).
        return self.layout.sp if gear == BASE else 1
