"""Tetris (CDSP): a prefill pool and decode instances in one group (Tetris §3.2, Fig. 4).

Ranks ``0 .. P·Tp-1`` are the prefill pool: ``P`` instances of TP ``Tp`` (instance ``m`` is ranks
``m·Tp ..``), each holding the whole model over its TP ranks; rank ``j`` of every instance shares
one point-to-point channel (``channels.py``), so any subset of instances can form a ring (per TP
index) without creating groups on the hot path (``chunked_prefill.run_chunk_plan``). The ranks after
the pool are the decode instances, ``T`` ranks each: an engine of its own (scheduler, paged KV,
sampler) whose leader is its first rank. A request runs its chunk plan on the pool; the members of
its last chunk's group hand their KV to the chosen decode instance piece by piece, each piece after
a transfer-slot handshake (``transfer.ReceiveManager``; with ``layerwise_transfer`` the handshake
runs during the prefill and each layer's rows leave as soon as they are computed); the decode
instance admits it into continuous batching once every piece has landed
(``admission.DecodeAdmission``).

The group is not one engine: requests go to the pool. It is started and served by the Tetris
group runtime at the launch/server floor (``group_runtime``: ``launch/tetris/`` runs the ranks
and the controller, ``server/tetris_engine.py`` is the worker endpoint). Across nodes, the
controller runs on node 0 and the other nodes' instances dial its control listener; an
instance's ranks share one node. This class is what every rank builds and what a decode leader's
engine asks.
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
from gearshift.worker.policies.tetris.admission import DecodeAdmission
from gearshift.worker.policies.tetris.channels import TetrisChannels, open_channels
from gearshift.worker.policies.tetris.decode import ReceiveHook
from gearshift.worker.policies.tetris.handoff import head_route, kv_heads_of

TETRIS_RUNTIME = "tetris"  # the group runtime that serves this policy (server/runtimes.py)


class TetrisPolicy(Policy):
    """A prefill pool of TP instances and TP decode instances (see the module docstring)."""

    kind = "tetris"

    def __init__(self, policy: policy_pb2.Policy, world_size: int) -> None:
        super().__init__(policy, world_size)
        msg = self.message
        self.prefill = int(msg.prefill_instances)
        self.prefill_tp = int(msg.prefill_tp)
        self.decode = int(msg.decode_instances)
        self.decode_tp = int(msg.decode_tp)
        self.gear_names = ("decode",)
        self.admission: DecodeAdmission | None = None
        self.hook: ReceiveHook | None = None

    # ---- roles -----------------------------------------------------------------------------

    @property
    def pool_ranks(self) -> int:
        """Ranks of the prefill pool: ``prefill`` instances of ``prefill_tp`` ranks each."""
        return self.prefill * self.prefill_tp

    def role(self, rank: int) -> tuple[str, int, int]:
        """("prefill" or "decode", instance, TP rank in the instance) of global ``rank``."""
        if rank < self.pool_ranks:
            m, j = divmod(rank, self.prefill_tp)
            return ("prefill", m, j)
        d, t = divmod(rank - self.pool_ranks, self.decode_tp)
        return ("decode", d, t)

    def prefill_ranks(self, instance: int) -> tuple[int, ...]:
        first = instance * self.prefill_tp
        return tuple(range(first, first + self.prefill_tp))

    def decode_ranks(self, instance: int) -> tuple[int, ...]:
        first = self.pool_ranks + instance * self.decode_tp
        return tuple(range(first, first + self.decode_tp))

    def pool_ranks_of(self, j: int) -> tuple[int, ...]:
        """TP index ``j``'s pool: rank ``j`` of every prefill instance, in instance order (a
        chunk's ring of instances runs per head shard, on its channel)."""
        return tuple(i * self.prefill_tp + j for i in range(self.prefill))

    def pool_comm(self, rank: int, channels: TetrisChannels) -> CommGroup:
        """A prefill rank's pool as a group (a pool of one instance has no channel)."""
        if channels.pool is not None:
            return channels.pool.comm
        return CommGroup.single()

    def group_runtime(self) -> str:
        """Not one engine: the pool and the decode instances are run by the Tetris runtime."""
        return TETRIS_RUNTIME

    # ---- every rank ------------------------------------------------------------------------

    def check_model(self, cfg: ModelConfig) -> None:
        for name, tp in (("prefillTp", self.prefill_tp), ("decodeTp", self.decode_tp)):
            try:
                Layout(tp=tp).check_model(cfg.num_heads, cfg.num_kv_heads)
                kv_heads_of(0, tp, cfg.num_kv_heads)
            except (InvalidRequestError, ValueError) as exc:
                raise InvalidRequestError(
                    f"policy.tetris.{name}", f"policy.tetris.{name}: {exc}"
                ) from exc

    def _instance_groups(self, rank: int, timeout: timedelta, backend: str | None) -> Any:
        """Every instance's TP group, prefill then decode (collective: every rank creates each,
        in order); returns this rank's, or None."""
        mine = None
        every = [self.prefill_ranks(m) for m in range(self.prefill)]
        every += [self.decode_ranks(d) for d in range(self.decode)]
        for ranks in every:
            members = list(ranks)
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
        pools = [self.pool_ranks_of(j) for j in range(self.prefill_tp)]
        slots = int(self.message.transfer_backends)
        channels = open_channels(ctx.rank, self.world_size, pools, slots, ctx.device, ctx.timeout)
        world = CommGroup(
            self.world_size, ctx.rank, tuple(range(self.world_size)), dist.group.WORLD
        )
        # Every rank sizes its cache as a decode rank does, so the group agrees on one count.
        local_heads = kv_heads_of(0, self.decode_tp, cfg.num_kv_heads)
        heads = local_heads.stop - local_heads.start
        if role == "prefill":
            members = self.prefill_ranks(index)
            tp = (
                CommGroup(len(members), t, members, tp_pg)
                if tp_pg is not None
                else CommGroup.single()
            )
            model = load_model(ctx.spec, ctx.open_source(), ctx.device, tp=tp, show_progress=False)
            gear = Gear("prefill", model, ctx.make_core(), CommGroup.single())
            return RankModel(
                gears=[gear],
                kv_layers=cfg.num_layers,
                kv_heads=heads,
                kv_allocator=lambda blocks: [],  # the pool keeps request KV in Holdings
                extra={"world": world, "instance": index, "channels": channels},
                closers=[channels.close],
                graph_gears=(),  # the pool only prefills (ring attention): no decode steps
            )
        members = self.decode_ranks(index)
        tp = CommGroup(len(members), t, members, tp_pg) if tp_pg is not None else CommGroup.single()
        model = load_model(
            ctx.spec, ctx.open_source(), ctx.device, tp=tp, show_progress=ctx.show_progress
        )
        sources = self._piece_sources(t, cfg.num_kv_heads)
        self.hook = ReceiveHook(list(channels.slots), sources=sources)
        return RankModel(
            gears=[Gear("decode", model, ctx.make_core(), CommGroup.single())],
            kv_layers=cfg.num_layers,
            kv_heads=model.num_kv_heads,
            hook=self.hook,
            extra={"world": world, "instance": index, "channels": channels},
            closers=[channels.close],
        )

    def _piece_sources(self, t: int, kv_heads: int) -> Callable[[int], list[tuple[int, int]]]:
        """Decode TP rank ``t``'s senders in a prefill instance: (rank, heads it sends)."""

        def sources(instance: int) -> list[tuple[int, int]]:
            out = []
            for j, rank in enumerate(self.prefill_ranks(instance)):
                heads = head_route(j, self.prefill_tp, t, self.decode_tp, kv_heads)
                if heads is not None:
                    out.append((rank, heads.stop - heads.start))
            return out

        return sources

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
        if self.admission is None:
            return StepRequest(StepKind.DECODE)
        return self.admission.step_request()

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
