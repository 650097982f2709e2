"""Plain data parallelism on SiDP's code path: the baseline SiDP is measured against (SiDP §5).

``dp`` independent replicas, each holding every weight (no FFN ownership, no slots, no step
boundary exchanges), built from the same pieces as a SiDP replica: every layer's FFN is a
``SidpFFN`` over owned weights, run by the same ``FfnService`` and, in decode steps, inside the
same fused decode op (``llama.LendsFfn``). So plain DP and SiDP WaS differ only in where a
remote layer's weights come from, and a benchmark comparing them compares that alone.

Not a user-facing policy: the benchmark (``benchmarks/sidp.py``) and the tests build it directly
from a ``sidp`` message whose ``mode`` is WAS (there is nothing to switch); it is not registered
under a kind.
"""

from __future__ import annotations

from typing import Any

import torch

from gearshift.v1 import policy_pb2
from gearshift.worker.comm import CommGroup
from gearshift.worker.engine.loading import load_model
from gearshift.worker.engine.model_runner import Gear
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.parallel.layout import Layout
from gearshift.worker.policies.base import RankContext, RankModel
from gearshift.worker.policies.sidp.ffn import FfnService, Mode, SidpFFN
from gearshift.worker.policies.sidp.followers import SendToFollowers
from gearshift.worker.policies.sidp.group_step import GroupStep
from gearshift.worker.policies.sidp.housekeeper import Housekeeper
from gearshift.worker.policies.sidp.ownership import Ownership, weight_bytes
from gearshift.worker.policies.sidp.policy import SidpPolicy
from gearshift.worker.policies.sidp.shared_weights import FfnLayout

NOTE = "plain DP baseline: every replica holds every weight; decode steps run the fused op"


class PlainDpPolicy(SidpPolicy):
    """``dp`` replicas of one rank, each with all its weights; SiDP's kernels and fused op."""

    def __init__(self, policy: policy_pb2.Policy, world_size: int) -> None:
        super().__init__(policy, world_size)
        if self.message.mode != policy_pb2.SidpPolicy.WAS:
            raise InvalidRequestError(
                "policy.sidp.mode", "policy.sidp.mode: plain DP has no modes to switch; give WAS"
            )
        if self.tp != 1:
            raise InvalidRequestError(
                "policy.sidp.tp", "policy.sidp.tp: the plain DP baseline runs tp 1"
            )

    def build_rank(self, ctx: RankContext) -> RankModel:
        cfg = ctx.spec.config
        self.check_model(cfg)
        layout = FfnLayout.of(cfg)
        dtype = ctx.spec.dtype
        # Every layer is this replica's own, in ordinary memory: nobody else reads it.
        owned = {
            layer: layout.views(torch.empty(layout.numel, dtype=dtype, device=ctx.device))
            for layer in range(cfg.num_layers)
        }
        nothing_remote = Housekeeper(
            layout=layout,
            num_layers=cfg.num_layers,
            order=[],
            cycle_start={},
            sources={},
            slots=0,
            prefetch_depth=1,
            peak_shifting=False,
            dtype=dtype,
            device=ctx.device,
        )
        service = FfnService(owned, nothing_remote, None, Mode.WAS)
        model = load_model(
            ctx.spec,
            ctx.open_source(),
            ctx.device,
            show_progress=ctx.show_progress,
            mlp_factory=lambda layer: SidpFFN(layer, service, owned[layer]),
        )
        self._service = service
        # One replica owning every layer: what each plain DP replica holds.
        self.bytes = weight_bytes(cfg, Ownership(1, cfg.num_layers), 0, 0, dtype.itemsize)
        gear = Gear("sidp", model, ctx.make_core(), CommGroup.single())
        self.resident_bytes = gear.weight_bytes()
        return RankModel(
            gears=[gear],
            kv_layers=cfg.num_layers,
            kv_heads=Layout().kv_heads_per_rank(cfg.num_kv_heads),
            kv_extra_bytes=0,
            extra={"service": service, "plain_dp": True},
            graph_gears=(),
            graph_note=NOTE,
        )

    def replica_sync(
        self, store: Any, followers: SendToFollowers | None = None
    ) -> GroupStep | None:
        return None  # plain DP replicas never meet

    def stats(self) -> dict[str, float]:
        service = self._service
        if service is None:
            return {}
        return {
            "sidp_mode": float(service.mode),
            "sidp_resident_weight_bytes": float(self.resident_bytes),
            "sidp_fused_layers": float(service.fused_layers),
        }

    def apply_group_live(self, store: Any, values: dict[str, Any]) -> None:
        if values:
            name = next(iter(values))
            raise InvalidRequestError(
                f"sidp.{name}", f"sidp.{name}: the plain DP baseline has no live parameters"
            )
