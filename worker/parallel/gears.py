"""Build this rank's gears for a policy: which model shards, which attention core, which groups."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from gearshift.worker.engine.loading import ModelSpec, load_model
from gearshift.worker.engine.model_runner import Gear
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.model.llama import AttentionCore
from gearshift.worker.model.weights import WeightSource
from gearshift.worker.parallel.comm import CommGroup
from gearshift.worker.parallel.groups import GroupSet
from gearshift.worker.parallel.layout import Layout
from gearshift.worker.parallel.ulysses import UlyssesAttention

log = logging.getLogger(__name__)


def build_gears(
    kind: str,
    layout: Layout,
    groups: GroupSet,
    spec: ModelSpec,
    open_source: Callable[[], WeightSource],
    inner: AttentionCore,
    device: torch.device,
    show_progress: bool = False,
) -> list[Gear]:
    """``static``: one gear (SP x TP); ``shift``: the base gear and the full-TP shift gear."""
    cfg = spec.config
    layout.check_model(cfg.num_heads, cfg.num_kv_heads)
    base_core: AttentionCore = inner
    if layout.sp > 1:
        base_core = UlyssesAttention(inner, groups.sp, groups.kv_aa, groups.kv_ag)
    base_model = load_model(spec, open_source(), device, tp=groups.tp, show_progress=show_progress)
    if kind == "static":
        return [Gear("static", base_model, base_core, groups.sp)]
    if kind != "shift":
        raise InvalidRequestError("policy", f"policy {kind!r} has no gears on this engine yet")
    # Shift §3.3.2: a separate copy of the weights sharded over all ranks in SP_TP order, so the
    # shift gear owns the heads the base gear owns after its all-to-all (KV cache invariance).
    shift_model = load_model(
        spec, open_source(), device, tp=groups.sp_tp, show_progress=show_progress
    )
    gears = [
        Gear("base", base_model, base_core, groups.sp),
        Gear("shift", shift_model, inner, CommGroup.single()),
    ]
    base_bytes, shift_bytes = gears[0].weight_bytes(), gears[1].weight_bytes()
    # Eq. (1): w_total = w/TP + w/(SP x TP).
    log.info(
        "shift policy weights on rank %d: base gear %.1f MiB (1/TP), shift gear %.1f MiB "
        "(1/(SPxTP)), total %.1f MiB",
        groups.world.rank,
        base_bytes / 2**20,
        shift_bytes / 2**20,
        (base_bytes + shift_bytes) / 2**20,
    )
    return gears
