"""One gear for every step: Ulysses SP × TP inside each of PP pipeline stages.

Pipeline parallel as vLLM users know it: stages hold contiguous layers (the embedding on the
first, the final norm and LM head on the last) and only their layers' KV; activations cross by
point-to-point send/recv; ``pp`` micro-batches are in flight, each over its own set of sequences
(vLLM's virtual engines), so every stage works on a different micro-batch at once.
"""

from __future__ import annotations

from gearshift.v1 import policy_pb2
from gearshift.worker.engine.contract import pipeline_share
from gearshift.worker.model.config import ModelConfig
from gearshift.worker.parallel.groups import create_groups
from gearshift.worker.parallel.layout import Layout
from gearshift.worker.parallel.pipeline import logits_channel
from gearshift.worker.policies.base import Policy, QueueView, RankContext, RankModel, StepRequest
from gearshift.worker.policies.gears import build_gear, pipeline_stage


class StaticPolicy(Policy):
    """One gear (``static``) over tp × sp × pp ranks."""

    kind = "static"

    def __init__(self, policy: policy_pb2.Policy, world_size: int) -> None:
        super().__init__(policy, world_size)  # static.spec refuses dp != 1
        msg = self.message
        self.layout = Layout(sp=msg.sp, tp=msg.tp, pp=msg.pp)
        self.gear_names = ("static",)

    def check_model(self, cfg: ModelConfig) -> None:
        self.layout.check_model(cfg.num_heads, cfg.num_kv_heads, cfg.num_layers)

    def build_rank(self, ctx: RankContext) -> RankModel:
        cfg = ctx.spec.config
        self.check_model(cfg)
        layout = self.layout
        groups = create_groups(layout, ctx.rank, cfg.num_kv_heads, ctx.timeout)
        logits = None
        if layout.pp > 1:
            logits = logits_channel(layout.world_size, ctx.rank, ctx.device, ctx.timeout)
        stage = pipeline_stage(layout, ctx, cfg.num_layers, groups.pp, logits)
        gear = build_gear("static", ctx, groups, groups.tp, layout.sp > 1, stage)
        last_stage_first_rank = (layout.pp - 1) * layout.stage_size
        return RankModel(
            gears=[gear],
            kv_layers=len(stage.layers) if stage is not None else cfg.num_layers,
            kv_heads=layout.kv_heads_per_rank(cfg.num_kv_heads),
            logits_rank=last_stage_first_rank,
            logits_channel=logits,
            closers=[c.close for c in (stage, logits) if c is not None],
        )

    def collectives(self) -> tuple[str, ...]:
        return self.layout.collectives()

    def micro_batches(self) -> int:
        return self.layout.pp

    def step_request(self, queues: QueueView) -> StepRequest:
        return pipeline_share(queues, self.layout.pp)

    def pad_multiple(self, gear: int) -> int:
        del gear
        return self.layout.sp
