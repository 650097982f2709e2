"""Tetris (CDSP): a prefill pool and decode instances in one group (Tetris §3.2, Fig. 4).

Ranks ``0 .. P-1`` are the prefill pool: ``P`` instances of TP 1, each holding the whole model,
all in the group's one process group, so any subset can form a ring by point-to-point without
creating groups on the hot path (``chunked_prefill.run_chunk_plan``). Ranks ``P + i·T .. P +
(i+1)·T - 1`` are decode instance ``i`` (TP ``T``): an engine of its own (scheduler, paged KV,
sampler) whose leader is its first rank. A request runs its chunk plan on the pool; the members
of its last chunk's group hand their KV to the chosen decode instance piece by piece, each piece
after a transfer-slot handshake (``transfer.ReceiveManager``); the decode instance admits it into
continuous batching once every piece has landed (``decode.DecodeAdmission``).

The group is served by its own endpoint (``group.py``, ``endpoint.py``): requests go to the pool,
not to one engine. Across nodes, the endpoint runs on node 0 and the other nodes' instances dial
its control listener (``group.run_tetris_node``); a decode instance's ranks share one node.
This class is what every rank builds and what a decode leader's engine asks.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from gearshift.v1 import policy_pb2
from gearshift.worker.comm import CommGroup
from gearshift.worker.engine.contract import QueueView, StepKind, StepRequest
from gearshift.worker.engine.loading import load_model
from gearshift.worker.engine.model_runner import Gear
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.model.config import ModelConfig
from gearshift.worker.parallel.layout import Layout
from gearshift.worker.policies.base import Policy, RankContext, RankModel
from gearshift.worker.policies.tetris.decode import DecodeAdmission, ReceiveHook
from gearshift.worker.policies.tetris.handoff import kv_heads_of


class TetrisPolicy(Policy):
    """A prefill pool of TP-1 instances and TP decode instances (see the module docstring)."""

    kind = "tetris"

    def __init__(self, policy: policy_pb2.Policy, world_size: int) -> None:
        super().__init__(policy, world_size)
        msg = self.message
        self.prefill = int(msg.prefill_instances)
        self.decode = int(msg.decode_instances)
        self.decode_tp = int(msg.decode_tp)
        self.gear_names = ("decode",)
        if msg.prefill_tp != 1:
            raise InvalidRequestError(
                "policy.tetris.prefillTp",
                "policy.tetris.prefillTp: prefill instances run TP 1 on this engine (the ring "
                f"attention shards tokens, not heads); got {msg.prefill_tp}",
            )
        if msg.layerwise_transfer:
            raise InvalidRequestError(
                "policy.tetris.layerwiseTransfer",
                "policy.tetris.layerwiseTransfer: this engine hands the KV over after the last "
                "chunk, in transfer-buffer pieces; layer-by-layer streaming is not implemented, "
                "set it to false",
            )
        self.admission: DecodeAdmission | None = None
        self.hook: ReceiveHook | None = None

    # ---- roles -----------------------------------------------------------------------------

    def role(self, rank: int) -> tuple[str, int, int]:
        """("prefill", instance, 0) or ("decode", instance, tp rank) of global ``rank``."""
        if rank < self.prefill:
            return ("prefill", rank, 0)
        d, t = divmod(rank - self.prefill, self.decode_tp)
        return ("decode", d, t)

    def decode_ranks(self, instance: int) -> tuple[int, ...]:
        first = self.prefill + instance * self.decode_tp
        return tuple(range(first, first + self.decode_tp))

    def group_handle(self) -> Callable[[Any], Any] | None:
        from gearshift.worker.policies.tetris.endpoint import TetrisGroupEngine

        return TetrisGroupEngine

    def node_runner(self) -> Callable[[Any, Any], int] | None:
        from gearshift.worker.policies.tetris.group import run_tetris_node

        return lambda config, group: run_tetris_node(config, self, group)

    def check_nodes(self, nodes: int) -> None:
        """Across nodes (§3.2): prefill instances may sit anywhere (a ring over nodes is
        point-to-point in the one group), but a decode instance's TP ranks share a node."""
        if nodes <= 1:
            return
        field = "spec.group.nodes"
        if self.world_size % nodes:
            raise InvalidRequestError(
                field, f"{field}: {self.world_size} ranks do not split over {nodes} nodes"
            )
        per = self.world_size // nodes
        for d in range(self.decode):
            ranks = self.decode_ranks(d)
            if ranks[0] // per != ranks[-1] // per:
                raise InvalidRequestError(
                    field,
                    f"{field}: with {nodes} nodes of {per} ranks, decode instance {d} (ranks "
                    f"{ranks[0]}-{ranks[-1]}, after {self.prefill} prefill ranks) would span two "
                    "nodes; its TP ranks must share one (change nodes, prefillInstances or "
                    "decodeTp)",
                )

    # ---- every rank ------------------------------------------------------------------------

    def check_model(self, cfg: ModelConfig) -> None:
        try:
            Layout(tp=self.decode_tp).check_model(cfg.num_heads, cfg.num_kv_heads)
            kv_heads_of(0, self.decode_tp, cfg.num_kv_heads)
        except (InvalidRequestError, ValueError) as exc:
            raise InvalidRequestError(
                "policy.tetris.decodeTp", f"policy.tetris.decodeTp: {exc}"
            ) from exc

    def _instance_groups(self, rank: int, timeout: timedelta, backend: str | None) -> Any:
        """Every decode instance's group (collective: every rank creates each, in order);
        returns this rank's, or None."""
        mine = None
        for d in range(self.decode):
            members = list(self.decode_ranks(d))
            if len(members) == 1:
                continue
            pg = dist.new_group(members, timeout=timeout, backend=backend)
            if rank in members:
                mine = pg
        return mine

    def build_rank(self, ctx: RankContext) -> RankModel:
        cfg = ctx.spec.config
        self.check_model(cfg)
        role, index, t = self.role(ctx.rank)
        tp_pg = self._instance_groups(ctx.rank, ctx.timeout, None)
        world = CommGroup(
            self.world_size, ctx.rank, tuple(range(self.world_size)), dist.group.WORLD
        )
        # Every rank sizes its cache as a decode rank does, so the group agrees on one count.
        local_heads = kv_heads_of(0, self.decode_tp, cfg.num_kv_heads)
        heads = local_heads.stop - local_heads.start
        if role == "prefill":
            model = load_model(ctx.spec, ctx.open_source(), ctx.device, show_progress=False)
            gear = Gear("prefill", model, ctx.make_core(), CommGroup.single())
            return RankModel(
                gears=[gear],
                kv_layers=cfg.num_layers,
                kv_heads=heads,
                kv_allocator=lambda blocks: [],  # the pool keeps request KV in Holdings
                extra={"world": world, "instance": index},
            )
        members = self.decode_ranks(index)
        tp = CommGroup(len(members), t, members, tp_pg) if tp_pg is not None else CommGroup.single()
        model = load_model(
            ctx.spec, ctx.open_source(), ctx.device, tp=tp, show_progress=ctx.show_progress
        )
        self.hook = ReceiveHook(world)
        return RankModel(
            gears=[Gear("decode", model, ctx.make_core(), CommGroup.single())],
            kv_layers=cfg.num_layers,
            kv_heads=model.num_kv_heads,
            hook=self.hook,
            extra={"world": world, "instance": index},
        )

    def instance_control(self, rank: int, timeout: timedelta) -> CommGroup | None:
        """This rank's decode instance's gloo control group (None for a one-rank instance or a
        pool rank); collective like ``_instance_groups``."""
        mine = None
        for d in range(self.decode):
            members = list(self.decode_ranks(d))
            if len(members) == 1:
                continue
            pg = dist.new_group(members, timeout=timeout, backend="gloo")
            if rank in members:
                mine = CommGroup(len(members), members.index(rank), tuple(members), pg)
        return mine

    # ---- a decode instance's leader ---------------------------------------------------------

    def bind(self, scheduler: Any, blocks: Any) -> None:
        self.admission = DecodeAdmission(scheduler, blocks, self.hook)

    def step_request(self, queues: QueueView) -> StepRequest:
        del queues
        return StepRequest(StepKind.DECODE)  # the pool prefills; a decode instance never does

    def plan_sections(self, batch: Any) -> dict[str, Any]:
        del batch
        return self.admission.plan_sections() if self.admission is not None else {}

    def step_submitted(self) -> None:
        if self.admission is not None:
            self.admission.step_submitted()

    def stats(self) -> dict[str, float]:
        if self.admission is None:
            return {}
        return {
            "transfers_in_flight": float(len(self.admission.incoming)),
            "admitted": float(self.admission.admitted),
        }
