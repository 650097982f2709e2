"""Building blocks the policy packages share: one gear, and this rank's pipeline stage."""

from __future__ import annotations

from gearshift.worker.attention.core import AttentionCore
from gearshift.worker.comm import CommGroup
from gearshift.worker.engine.loading import load_model
from gearshift.worker.engine.model_runner import Gear
from gearshift.worker.p2p import P2P
from gearshift.worker.parallel.groups import GroupSet
from gearshift.worker.parallel.layout import Layout, stage_layers
from gearshift.worker.parallel.pipeline import PipelineStage
from gearshift.worker.parallel.ulysses import UlyssesAttention
from gearshift.worker.policies.base import RankContext


def pipeline_stage(
    layout: Layout, ctx: RankContext, num_layers: int, p2p: CommGroup, logits: P2P | None
) -> PipelineStage | None:
    """This rank's stage of ``layout`` (None without pipeline parallelism), its activations on
    a channel over ``p2p`` (collective: every rank calls it) and, on the rank that makes the
    logits, ``logits`` (pipeline.logits_channel) to send them to the leader."""
    if layout.pp == 1:
        return None
    rank = ctx.rank
    index = layout.stage(rank)
    size = layout.stage_size
    local = layout.local_rank(rank)
    last = index == layout.pp - 1
    sends_logits = last and local == 0  # it holds the full logits; the leader (rank 0) samples
    name = f"pipeline activations (pp {layout.pp} x {size})"
    # GroupSet.pp numbers stages; the channel's peers are ranks of the group (here: global).
    everyone = CommGroup(len(p2p.ranks), p2p.ranks.index(rank), p2p.ranks, p2p.group)
    return PipelineStage(
        index=index,
        count=layout.pp,
        layers=stage_layers(num_layers, layout.pp, index),
        prev_rank=rank - size if index > 0 else None,
        next_rank=rank + size if not last else None,
        logits_to=0 if sends_logits else None,
        activations=P2P(everyone, name, ctx.device, ctx.timeout),
        logits=logits if sends_logits else None,
        depth=layout.pp,
    )


def build_gear(
    name: str,
    ctx: RankContext,
    groups: GroupSet,
    tp: CommGroup,
    ulysses: bool,
    stage: PipelineStage | None = None,
) -> Gear:
    """Load this rank's shard (``tp``'s slice of ``stage``'s layers) with its attention core:
    Ulysses around the backend when the gear splits tokens over SP (Shift §3.2)."""
    core: AttentionCore = ctx.make_core()
    if ulysses:
        core = UlyssesAttention(core, groups.sp, groups.kv_aa, groups.kv_ag)
    model = load_model(
        ctx.spec,
        ctx.open_source(),
        ctx.device,
        tp=tp,
        show_progress=ctx.show_progress,
        layers=stage.layers if stage is not None else None,
    )
    return Gear(name, model, core, groups.sp if ulysses else CommGroup.single(), stage)
