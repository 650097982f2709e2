"""SiDP: dp engine replicas that share FFN weights (SiDP §4).

Each replica (``tp`` ranks, tensor-parallel inside) is an independent engine (own scheduler, block
manager, KV cache, sampler).
Attention, norms, embeddings and the LM head are replicated; layer ℓ's FFN lives only on replica
ℓ mod dp (§4.1), in shared memory the other replicas of the host read (§4.2). The KV cache gets
the FFN bytes a replica does not hold. A step runs in one of two modes, the same on every replica:
WaS (prefetch remote weights into cache slots, compute locally) or CaS (ship activations to the
owner, §4.3); ``mode`` pins one, AUTO leaves it to the router's controller.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gearshift.v1 import policy_pb2
from gearshift.worker import shm_segments
from gearshift.worker.comm import CommGroup
from gearshift.worker.engine.loading import load_model
from gearshift.worker.engine.model_runner import Gear
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.model.config import ModelConfig
from gearshift.worker.parallel.layout import Layout
from gearshift.worker.policies.base import Policy, RankContext, RankModel
from gearshift.worker.policies.sidp.calibrate import measure_modes
from gearshift.worker.policies.sidp.cas import CasExchange
from gearshift.worker.policies.sidp.device_prefetch import DEVICE_PREFETCH_ENV, DevicePrefetch
from gearshift.worker.policies.sidp.ffn import FfnService, Mode, SidpFFN
from gearshift.worker.policies.sidp.followers import FollowerHook, SendToFollowers
from gearshift.worker.policies.sidp.gpu_topology import check_peer_access
from gearshift.worker.policies.sidp.group_step import GroupStep, request_mode
from gearshift.worker.policies.sidp.handles import Expect, RankSegments, SegmentAddress, exchange
from gearshift.worker.policies.sidp.housekeeper import Housekeeper
from gearshift.worker.policies.sidp.overlap import CasOverlap
from gearshift.worker.policies.sidp.ownership import Ownership, WeightBytes, weight_bytes
from gearshift.worker.policies.sidp.shared_weights import (
    DeviceSegment,
    FfnLayout,
    Segment,
    clean_stale,
    new_segment_name,
)
from gearshift.worker.policies.sidp.source import HideRemoteFfn
from gearshift.worker.policies.sidp.thresholds import (
    PROFILE_ENV,
    SOURCE_DEFAULT,
    SOURCE_EXPLICIT,
    ModeProfile,
    load_profile,
)

log = logging.getLogger(__name__)


def _attach(address: SegmentAddress, nbytes: int) -> Segment | DeviceSegment:
    """Map a peer's checked shard: GPU memory over CUDA IPC, or a host segment by its name."""
    if address.cuda is not None:
        return DeviceSegment.attach(address.name, address.cuda)
    return Segment(address.name, nbytes, create=False)


def prefetcher(on_gpu: bool) -> type[Housekeeper]:
    """WaS's slot filler: on a GPU the device-side one (its waits on the device, so decode steps
    can be captured as graphs); on CPU the housekeeper thread, unless the environment asks for
    the device-side schedule (tests run it on CPU)."""
    raw = os.environ.get(DEVICE_PREFETCH_ENV, "")
    if raw not in ("", "0", "1"):
        raise InvalidRequestError(
            DEVICE_PREFETCH_ENV, f"{DEVICE_PREFETCH_ENV} must be 0 or 1, not {raw!r}"
        )
    return DevicePrefetch if on_gpu or raw == "1" else Housekeeper


# Why SiDP's decode steps are not replayed from CUDA graphs (issue 27).
GRAPH_NOTE = (
    "sidp decode steps run eagerly. WaS: on CPU the housekeeper thread makes compute wait on the "
    "host for each layer's copy; on a GPU the device-side prefetcher (device_prefetch.py) queues "
    "the same copies every pass, which a graph could hold, but its capture has not run on a GPU, "
    "so it stays eager until it has. CaS: the exchange with the layer's owner is decided on the "
    "host each step (dummy skipping), which a replayed graph would not run."
)


# Group figures every replica reports alike (thresholds.ModeProfile.figures).
_PROFILE_FIGURES = (
    "sidp_thresholds_source",
    "sidp_auto_pins_was",
    "sidp_cas_enter_batch_size",
    "sidp_was_enter_batch_size",
    "sidp_profile_",
)


class SidpPolicy(Policy):
    """dp replicas of tp ranks each sharing FFN weights; ``mode`` and thresholds are live."""

    kind = "sidp"

    def __init__(self, policy: policy_pb2.Policy, world_size: int) -> None:
        super().__init__(policy, world_size)
        msg = self.message
        self.dp = int(msg.dp)
        self.tp = int(msg.tp)
        self.gear_names = ("sidp",)  # sidp.spec refuses too few WaS slots for peak shifting
        self._service: FfnService | None = None
        self._world: CommGroup | None = None
        self._sync: GroupStep | None = None
        self.bytes: WeightBytes | None = None
        self.resident_bytes = 0
        self.peer_context_bytes = 0  # other ranks' CUDA contexts on this rank's GPU
        self.was_refused: str | None = None  # why WaS cannot run on these GPUs
        # AUTO's thresholds (§4.3 B_th): set in the policy, else from PROFILE_ENV's file, else
        # measured at start-up (calibrate.py) when the group starts in AUTO.
        given = [
            f for f in ("cas_enter_batch_size", "was_enter_batch_size") if policy.sidp.HasField(f)
        ]
        self.thresholds_source = SOURCE_EXPLICIT if given else SOURCE_DEFAULT
        self.profile: ModeProfile | None = None
        path = os.environ.get(PROFILE_ENV, "")
        if path and given:
            # Thresholds the policy sets win (a group re-created from its running policy, which
            # always carries them, lands here too).
            log.info("sidp: policy.sidp.%s is set; %s is not used", given[0], PROFILE_ENV)
            path = ""
        if path:
            self._use_profile(load_profile(path))

    def _use_profile(self, profile: ModeProfile) -> None:
        """Take AUTO's thresholds from ``profile`` (none when CaS never won: AUTO pins WaS)."""
        self.profile = profile
        self.thresholds_source = profile.source
        found = profile.thresholds
        if found is not None:
            self._message.cas_enter_batch_size, self._message.was_enter_batch_size = found

    @property
    def initial_mode(self) -> Mode:
        return Mode.CAS if self.message.mode == policy_pb2.SidpPolicy.CAS else Mode.WAS

    def engine_replicas(self) -> int:
        return self.dp

    def check_model(self, cfg: ModelConfig) -> None:
        if cfg.num_layers < self.dp:
            raise InvalidRequestError(
                "policy.sidp.dp",
                f"policy.sidp.dp ({self.dp}) exceeds the model's {cfg.num_layers} layers",
            )
        try:
            Layout(tp=self.tp).check_model(cfg.num_heads, cfg.num_kv_heads)
        except InvalidRequestError as exc:
            raise InvalidRequestError("policy.sidp.tp", f"policy.sidp.tp: {exc}") from exc
        if cfg.intermediate_size % self.tp:
            raise InvalidRequestError(
                "policy.sidp.tp",
                f"policy.sidp.tp ({self.tp}) does not divide the FFN's {cfg.intermediate_size} "
                "intermediate features",
            )

    def _groups(self, rank: int, timeout: timedelta) -> tuple[CommGroup, CommGroup, CommGroup]:
        """(this replica's TP group, this TP rank's peers: TP rank t of every replica, the
        replicas' leading ranks over gloo: the step boundaries' small CPU exchanges).

        Replica r is ranks [r * tp, (r + 1) * tp) (its leader first, as engine_replicas says);
        every rank creates every group in the same order (new_group is collective)."""
        dp, tp = self.dp, self.tp
        world = dist.group.WORLD if self.world_size > 1 else None
        on_gloo = world is None or dist.get_backend() == "gloo"
        mine: dict[str, CommGroup] = {}
        for kind, groups in (
            ("tp", [[r * tp + t for t in range(tp)] for r in range(dp)]),
            ("peers", [[r * tp + t for r in range(dp)] for t in range(tp)]),
            ("leaders", [[r * tp for r in range(dp)]]),
        ):
            for members in groups:
                if len(members) == 1:
                    pg = None
                elif len(members) == self.world_size and (kind != "leaders" or on_gloo):
                    pg = world  # the whole group already is this one
                else:
                    backend = "gloo" if kind == "leaders" else None
                    pg = dist.new_group(members, timeout=timeout, backend=backend)
                if rank in members:
                    mine[kind] = CommGroup(len(members), members.index(rank), tuple(members), pg)
        leaders = mine.get("leaders", CommGroup.single())
        return mine["tp"], mine["peers"], leaders

    def build_rank(self, ctx: RankContext) -> RankModel:
        cfg = ctx.spec.config
        self.check_model(cfg)
        msg = self.message
        own = Ownership(self.dp, cfg.num_layers)
        tp_group, peers, leaders = self._groups(ctx.rank, ctx.timeout)
        replica, tp_rank = ctx.rank // self.tp, ctx.rank % self.tp
        layout = FfnLayout.of(cfg, self.tp)
        dtype = ctx.spec.dtype
        nbytes = layout.numel * torch.tensor([], dtype=dtype).element_size()
        on_gpu = ctx.device.type == "cuda"
        key = shm_segments.group_key()
        mine: dict[int, Segment | DeviceSegment] = {}
        if on_gpu:
            # Owned FFN shards live in device memory; readers map them over CUDA IPC.
            for layer in own.owned(replica):
                name = new_segment_name(key, layer, tp_rank)
                mine[layer] = DeviceSegment.create(name, layout.numel, dtype, ctx.device)
        else:
            clean_stale()
            for layer in own.owned(replica):
                name = new_segment_name(key, layer, tp_rank)
                mine[layer] = Segment(name, nbytes, create=True)
        segments = list(mine.values())
        try:
            everyone = exchange(
                RankSegments(
                    ctx.rank,
                    (ctx.device.index or 0) if on_gpu else None,
                    [
                        SegmentAddress(
                            layer,
                            tp_rank,
                            seg.name,
                            seg.address() if isinstance(seg, DeviceSegment) else None,
                        )
                        for layer, seg in mine.items()
                    ],
                ),
                Expect(
                    key,
                    {r: own.owned(r) for r in range(self.dp)},
                    self.tp,
                    layout.numel,
                    dtype,
                    on_gpu,
                ),
                self.world_size,
            )
            addresses = {(s.layer, s.tp_rank): s for msg in everyone for s in msg.segments}
            devices = {msg.rank: msg.device for msg in everyone if msg.device is not None}
            if on_gpu:
                owners = {
                    devices[own.owner(layer) * self.tp + tp_rank] for layer in own.remote(replica)
                }
                try:
                    check_peer_access(
                        ctx.device.index or 0,
                        owners,
                        list(devices.values()),
                        torch.cuda.can_device_access_peer,
                    )
                except InvalidRequestError as exc:
                    if msg.mode != policy_pb2.SidpPolicy.CAS:
                        raise
                    self.was_refused = exc.message  # pinned CaS: WaS may not be asked for live
            free_before = torch.cuda.mem_get_info(ctx.device)[0] if on_gpu else 0
            # TP rank t reads TP rank t's shard of each owner (§4.2 per TP rank).
            remote: dict[int, Segment | DeviceSegment] = {
                layer: _attach(addresses[(layer, tp_rank)], nbytes) for layer in own.remote(replica)
            }
            segments += list(remote.values())
            if on_gpu and self.world_size > 1:
                # Every rank has mapped its owners' memory (one CUDA context per other GPU it
                # touches) before any rank sizes its KV cache: what they took is gone from
                # the free memory the sizing reads. Measured here for the stats.
                dist.barrier()
                self.peer_context_bytes = max(
                    0, free_before - torch.cuda.mem_get_info(ctx.device)[0]
                )
            owned = {layer: layout.views(seg.tensor(dtype)) for layer, seg in mine.items()}
            housekeeper = prefetcher(on_gpu)(
                layout=layout,
                num_layers=cfg.num_layers,
                order=own.fetch_order(replica, msg.peak_shifting),
                cycle_start={layer: c.start for c in own.cycles() for layer in c},
                sources={layer: seg.tensor(dtype) for layer, seg in remote.items()},
                slots=int(msg.was_cache_slots) if self.dp > 1 else 0,
                prefetch_depth=int(msg.prefetch_depth),
                peak_shifting=msg.peak_shifting,
                dtype=dtype,
                device=ctx.device,
            )
            cas = CasExchange(
                own,
                replica,
                peers,
                int(msg.cas_slots),
                layout,
                dtype,
                msg.dummy_skipping,
                owned,
                tp_rank=tp_rank,
                device=ctx.device,
                timeout=ctx.timeout,
                overlap=msg.cas_overlap,
            )
            service = FfnService(owned, housekeeper, cas, self.initial_mode, tp_group)
            core = ctx.make_core()
            model = load_model(
                ctx.spec,
                HideRemoteFfn(ctx.open_source(), set(own.remote(replica))),
                ctx.device,
                tp=tp_group,
                show_progress=ctx.show_progress,
                mlp_factory=lambda layer: SidpFFN(layer, service, owned.get(layer)),
            )
            # CaS steps run as two overlapping micro-batches where a replica can split its rows.
            model.layer_runner = CasOverlap(service, cas)
            if on_gpu:
                torch.cuda.synchronize(ctx.device)  # the owned shards are written on the device
            if self.world_size > 1:
                dist.barrier()  # every owner's segments are written before anyone reads them
        except BaseException:
            for seg in segments:
                seg.close()
            raise
        if service.mode == Mode.WAS:
            housekeeper.start()
        if (
            self.profile is None
            and self.thresholds_source == SOURCE_DEFAULT
            and msg.mode == policy_pb2.SidpPolicy.AUTO
            and self.dp > 1
        ):
            try:
                self._use_profile(
                    measure_modes(model, core, service, cas, ctx.block_size, ctx.device)
                )
            except BaseException:
                housekeeper.close()
                cas.close()
                for seg in segments:
                    seg.close()
                raise
            if ctx.rank == 0:
                assert self.profile is not None
                log.warning("sidp: %s", self.profile.why())
        self._service, self._world = service, leaders
        self.bytes = weight_bytes(cfg, own, replica, housekeeper.slots, dtype.itemsize, self.tp)
        log.info(
            "sidp replica %d tp rank %d: owns FFN of layers %s; weights %.1f MiB resident "
            "(%d slots), %.1f MiB freed for KV",
            replica,
            tp_rank,
            own.owned(replica),
            self.bytes.resident / 2**20,
            housekeeper.slots,
            self.bytes.freed(cfg.num_layers) / 2**20,
        )

        def close() -> None:
            housekeeper.close()
            cas.close()
            for seg in segments:
                seg.close()

        gear = Gear("sidp", model, core, CommGroup.single())
        # What this rank really holds: its parameters (owned FFN layers included, in shared
        # memory) and its WaS slots; the tests hold it to WeightBytes.resident.
        self.resident_bytes = gear.weight_bytes() + housekeeper.slot_bytes
        return RankModel(
            gears=[gear],
            kv_layers=cfg.num_layers,
            kv_heads=Layout(tp=self.tp).kv_heads_per_rank(cfg.num_kv_heads),
            kv_extra_bytes=max(0, self.bytes.freed(cfg.num_layers)),
            closers=[close],
            # A TP follower takes each step's mode from its replica's leader.
            hook=FollowerHook(service, cas) if tp_rank else None,
            extra={"service": service, "weight_bytes": self.bytes},
            graph_gears=(),
            graph_note=GRAPH_NOTE,
        )

    def replica_sync(
        self, store: Any, followers: SendToFollowers | None = None
    ) -> GroupStep | None:
        if self._service is None or self._world is None:
            return None
        cas = self._service.cas
        assert isinstance(cas, CasExchange)
        self._sync = GroupStep(
            self._service, cas, self._world, store, self.initial_mode, followers=followers
        )
        return self._sync

    def stats(self) -> dict[str, float]:
        service = self._service
        if service is None:
            return {}
        was, cas = service.housekeeper.stats, service.cas
        out = {
            "sidp_mode": float(service.mode),
            "sidp_resident_weight_bytes": float(self.resident_bytes),
            "sidp_fetched_weight_bytes": float(was.fetched_bytes),
            "sidp_slot_waits": float(was.slot_waits),
            "sidp_peer_context_bytes": float(self.peer_context_bytes),
            "sidp_fused_layers": float(service.fused_layers),
            "sidp_thresholds_source": float(self.thresholds_source),
        }
        if self.profile is not None:
            out.update(self.profile.figures())
        if isinstance(cas, CasExchange):
            out["sidp_cas_fused_rows"] = float(cas.stats.fused_rows)
            out["sidp_skipped_dummies"] = float(cas.stats.skipped_dummies)
            out["sidp_cas_overlapped"] = float(cas.stats.overlapped)
            out["sidp_cas_overlapped_moving"] = float(cas.stats.overlapped_moving)
        if self._sync is not None:
            out["sidp_switches"] = float(self._sync.switches)
        return out

    def group_stats(self, replicas: list[dict[str, float]]) -> dict[str, float]:
        """The group's mode and switches (the same on every replica after a boundary: the
        newest), counters summed over replicas, and each replica's own figures."""
        out = super().group_stats(replicas)
        for key in ("sidp_mode", "sidp_switches"):
            values = [part[key] for part in replicas if key in part]
            if values:
                out[key] = max(values)
        for key in (
            "sidp_fetched_weight_bytes",
            "sidp_slot_waits",
            "sidp_cas_fused_rows",
            "sidp_skipped_dummies",
            "sidp_cas_overlapped",
            "sidp_cas_overlapped_moving",
        ):
            out[key] = sum(part.get(key, 0.0) for part in replicas)
        # AUTO's thresholds and the profile behind them: the same on every replica (the figures
        # are agreed over the group). Thresholds set live since then are the policy's own.
        if self.thresholds_source == SOURCE_EXPLICIT:
            out["sidp_thresholds_source"] = float(SOURCE_EXPLICIT)
        elif replicas:
            out.update(
                (key, value)
                for key, value in replicas[0].items()
                if key.startswith(_PROFILE_FIGURES)
            )
        return out

    def apply_group_live(self, store: Any, values: dict[str, Any]) -> None:
        """A pinned ``mode`` reaches every replica at one step boundary (group_step); the
        controller's thresholds are the router's. What a running replica cannot take is refused."""
        for name in ("prefetch_depth", "dummy_skipping", "cas_overlap"):
            if name in values:
                raise InvalidRequestError(
                    f"sidp.{name}",
                    f"sidp.{name} cannot be changed while a replica group runs (restart it)",
                )
        if "cas_enter_batch_size" in values or "was_enter_batch_size" in values:
            self.thresholds_source = SOURCE_EXPLICIT  # the router now runs the given ones
        mode = values.get("mode")
        if mode in ("WAS", "AUTO") and self.was_refused is not None:
            raise InvalidRequestError("sidp.mode", self.was_refused)
        if mode in ("WAS", "CAS"):
            request_mode(store, Mode.WAS if mode == "WAS" else Mode.CAS)

    def release_group(self) -> None:
        """A killed replica (or its peers, killed with it) leaves its FFN segments behind."""
        clean_stale()
