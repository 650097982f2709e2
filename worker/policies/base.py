"""The step contract between the engine and a parallelism policy (DESIGN.md: step contract).

A policy is one package under ``worker/policies/`` that owns everything about its technique:

- reading its proto message (``gearshift.v1.Policy``, the one schema) and checking the model;
- on every rank, the process groups, gears and KV shape it needs (``build_rank``);
- on the leader, how steps are scheduled (``micro_batches``, ``step_request``: prefill-only or
  decode-only steps, how many sequences a micro-batch may take) and which gear runs a scheduled
  batch (``choose_gear``);
- its live parameters (kept in its proto message, so the active policy *is* the proto) and its
  stats.

The engine and the launcher call only these methods; nothing else dispatches on the policy kind.
A policy whose group is not one engine names the group runtime that serves it
(``group_runtime``); the runtimes live at the launch/server floor, above every policy.
Each kind has a torch-free spec (``spec.py``: layout, defaults, rules), registered in
``kinds.py``; ``registry.make_policy`` builds the class the spec names.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from gearshift.v1 import policy_fields, policy_pb2
from gearshift.worker.attention.core import AttentionCore
from gearshift.worker.engine.contract import (
    LiveValue,
    QueueView,
    ReplicaSync,
    SectionValues,
    StepKind,
    StepRequest,
)
from gearshift.worker.engine.device_memory import DeviceLedger
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.model.config import ModelConfig
from gearshift.worker.p2p import P2P
from gearshift.worker.policies import checks, kinds, live_values

if TYPE_CHECKING:
    from gearshift.worker.engine.loading import ModelSpec
    from gearshift.worker.engine.model_runner import Gear, RankHook
    from gearshift.worker.engine.plan import StepPlan
    from gearshift.worker.engine.scheduler import ScheduledBatch, Scheduler
    from gearshift.worker.kv.block_manager import BlockManager
    from gearshift.worker.kv.cache import LayerKV
    from gearshift.worker.model.weights import WeightSource

__all__ = [
    "ENGINE_RUNTIME",
    "REPLICAS_RUNTIME",
    "LiveValue",
    "Policy",
    "QueueView",
    "RankContext",
    "RankModel",
    "StepKind",
    "StepRequest",
]


# Policy.group_runtime() of the two shapes of group the launcher itself starts.
ENGINE_RUNTIME = "engine"  # one engine led by rank 0 (launch/leader.py)
REPLICAS_RUNTIME = "replicas"  # independent engine replicas (launch/replicas.py)


@dataclass(frozen=True)
class RankContext:
    """What a policy needs to build its part of the group on one rank."""

    rank: int
    world_size: int
    spec: ModelSpec
    open_source: Callable[[], WeightSource]
    make_core: Callable[[], AttentionCore]
    device: torch.device
    timeout: timedelta = timedelta(seconds=120)
    show_progress: bool = False
    block_size: int = 16  # tokens per KV block (EngineConfig.block_size)
    # The rank's count of device memory: a policy records what it allocates on the device.
    ledger: DeviceLedger = field(default_factory=DeviceLedger)


@dataclass
class RankModel:
    """One rank's share of a group: its gears and the shape of its KV cache."""

    gears: list[Gear]
    kv_layers: int  # decoder layers whose KV this rank holds
    kv_heads: int  # KV heads per layer on this rank
    logits_rank: int = 0  # global rank where the full logits appear (a pipeline's last stage)
    logits_channel: P2P | None = None  # what the leader receives those logits over, if elsewhere
    extra: dict[str, Any] = field(default_factory=dict)
    # Weight bytes the policy freed on this rank (e.g. FFN layers held by another rank); the KV
    # cache gets them on top of its budget.
    kv_extra_bytes: int = 0
    # Called once when the rank's runner shuts down: threads and shared memory the gears hold.
    closers: list[Callable[[], None]] = field(default_factory=list)
    hook: RankHook | None = None  # the policy's work before each plan on this rank
    # Allocates this rank's KV cache for a block count (default: kv/cache.allocate_kv_cache of
    # kv_layers x kv_heads); a policy whose gears view one buffer differently supplies its own.
    kv_allocator: Callable[[int], list[LayerKV]] | None = None
    # Gears whose decode-only steps may replay captured graphs (launch/rank_graphs); None: every
    # gear. A policy whose forward cannot be captured lists fewer and says why in graph_note.
    graph_gears: tuple[int, ...] | None = None
    graph_note: str = ""
    # Gears that take turns holding the device (Seesaw): put gear i's weights there, so that its
    # graphs can be captured at start-up; the rank's first gear is put back afterwards.
    activate_gear: Callable[[int], None] | None = None
    # The KV views gear i reads, when gears view the cache differently (default: the runner's).
    gear_kv: Callable[[int], list[LayerKV]] | None = None


class Policy(ABC):
    """One parallelism technique (see the module docstring for the contract)."""

    kind: ClassVar[str]  # the kind in spec.policy; its spec is registered (kinds.py)
    gear_names: tuple[str, ...]

    def __init__(self, policy: policy_pb2.Policy, world_size: int) -> None:
        """``policy`` with this kind set; defaults are filled in for ``world_size`` ranks and
        everything its spec refuses is refused here (checks.refuse)."""
        full = checks.refuse(policy, world_size)
        self.world_size = world_size
        spec = kinds.spec_of(self.kind)
        assert spec is not None  # refuse() found it
        self.policy_spec = spec
        self._message = policy_fields.copy_of(full)

    @property
    def message(self) -> Any:
        """This policy's own proto message (e.g. ``policy_pb2.ShiftPolicy``), defaults filled."""
        return self._message

    @property
    def single_node(self) -> bool:
        """Every rank of a group must share one host (e.g. KV in one node's shared memory)."""
        return bool(self.policy_spec.single_node)

    def to_proto(self) -> policy_pb2.Policy:
        """The active policy, live values included (a copy)."""
        return policy_fields.policy_of(self.kind, self._message)

    def check_nodes(self, nodes: int) -> None:
        """Refuse a group spread over ``nodes`` nodes of ``world_size // nodes`` consecutive
        ranks each that this policy cannot place, naming ``spec.group.nodes``."""
        why = self.policy_spec.nodes_error(self._message, self.world_size, nodes)
        if why:
            field = "spec.group.nodes"
            raise InvalidRequestError(field, f"{field}: {why}")

    # ---- every rank ------------------------------------------------------------------------

    def check_model(self, cfg: ModelConfig) -> None:
        """Refuse a model this layout cannot split, naming the field (before any rank starts)."""
        del cfg

    @abstractmethod
    def build_rank(self, ctx: RankContext) -> RankModel:
        """Create this rank's process groups and gears (collective: every rank calls it)."""

    # ---- the leader ------------------------------------------------------------------------

    def collectives(self) -> tuple[str, ...]:
        """The collectives the group's steps run, by parallel/collective_timing.py's names, for
        ``gearshift profile`` to time on the running group (none: nothing timed)."""
        return ()

    def micro_batches(self) -> int:
        """Steps the engine keeps in flight (pipeline stages); 1 runs one step at a time."""
        return 1

    def engine_replicas(self) -> int:
        """Independent engines (scheduler, KV cache, sampler each) the group's ranks form; 1: the
        group is one engine led by rank 0. Ranks ``r * (world / n)`` lead replica ``r``."""
        return 1

    def group_runtime(self) -> str:
        """The name of the group runtime that starts and serves this policy's group (the table
        is at the launch/server floor, ``server/runtimes.py``): ``ENGINE_RUNTIME`` for one engine
        led by rank 0, ``REPLICAS_RUNTIME`` for ``engine_replicas() > 1``; a policy whose group
        has another shape (Tetris: a prefill pool and decode instances) names its own."""
        return REPLICAS_RUNTIME if self.engine_replicas() > 1 else ENGINE_RUNTIME

    def replica_sync(
        self, store: Any, followers: Callable[[StepPlan], None] | None = None
    ) -> ReplicaSync | None:
        """After ``build_rank``, on a replica's leading rank: how it meets its peers at step
        boundaries (``store``: the group's rendezvous store; ``followers``: sends a plan to the
        replica's other ranks, when it has some); None: replicas never meet."""
        del store, followers
        return None

    def step_request(self, queues: QueueView) -> StepRequest:
        """The policy's say in the next step, before the scheduler builds it."""
        del queues
        return StepRequest()

    def choose_gear(self, batch: ScheduledBatch) -> int:
        """Index into ``gear_names`` of the gear that runs ``batch``."""
        del batch
        return 0

    def pad_multiple(self, gear: int) -> int:
        """The token count of a step of ``gear`` is padded to a multiple of this (Ulysses SP)."""
        del gear
        return 1

    def stats(self) -> dict[str, float]:
        """Policy-specific figures for GetStats and metrics (empty by default)."""
        return {}

    def group_stats(self, replicas: list[dict[str, float]]) -> dict[str, float]:
        """A replica group's figures from each replica's ``stats()`` (in order), for the one
        worker endpoint that serves the group; by default each figure per replica."""
        return {f"replica{r}_{k}": v for r, part in enumerate(replicas) for k, v in part.items()}

    def release_group(self) -> None:
        """In the process that hosted a replica group, once its processes are gone (stopped or
        killed): release the host resources a killed replica could not (nothing by default)."""
        return None

    def apply_group_live(self, store: Any, values: dict[str, LiveValue]) -> None:
        """After ``update_live`` in the process that hosts a replica group (its rendezvous
        ``store``): pass what the replicas must see at a step boundary (nothing by default)."""
        del store, values

    def bind(self, scheduler: Scheduler, blocks: BlockManager) -> None:
        """The leader's scheduler and KV blocks, for a policy that moves KV between tiers."""
        del scheduler, blocks

    def held(self) -> frozenset[str]:
        """Requests the scheduler must leave alone this step (none by default)."""
        return frozenset()

    def plan_sections(self, batch: ScheduledBatch) -> Mapping[str, SectionValues]:
        """Sections for the next plan (none by default)."""
        del batch
        return {}

    def step_submitted(self) -> None:
        """The plan with the last ``plan_sections`` reached every rank (nothing by default)."""
        return None

    # ---- live parameters -------------------------------------------------------------------

    def live_parameters(self) -> dict[str, LiveValue]:
        """Fields of this policy's message marked ``(live) = true``, with their values."""
        out: dict[str, LiveValue] = {}
        msg = self.message
        for f in msg.DESCRIPTOR.fields:
            if policy_fields.is_live(f) and f.is_repeated:
                out[f.name] = live_values.items_of(f, getattr(msg, f.name))
            elif policy_fields.is_live(f) and f.type != FieldDescriptor.TYPE_MESSAGE:
                value = getattr(msg, f.name)
                if f.type == FieldDescriptor.TYPE_ENUM:
                    value = f.enum_type.values_by_number[int(value)].name
                out[f.name] = value
        return out

    def update_live(self, values: dict[str, LiveValue]) -> None:
        """Apply live parameters; refuses unknown names or bad values, changing nothing."""
        current = self.live_parameters()
        msg = type(self._message)()
        msg.CopyFrom(self._message)
        for name, value in values.items():
            if name not in current:
                raise InvalidRequestError(
                    f"{self.kind}.{name}", f"{self.kind}.{name} cannot be changed while running"
                )
            self._set(msg, name, value)
        errors = checks.layout_errors(policy_fields.policy_of(self.kind, msg), self.world_size)
        if errors:
            raise InvalidRequestError(f"policy.{self.kind}", "; ".join(errors))
        self._message = msg

    def _set(self, msg: Message, name: str, value: LiveValue) -> None:
        path = f"{self.kind}.{name}"
        f = msg.DESCRIPTOR.fields_by_name[name]
        if f.is_repeated:
            live_values.set_items(msg, f, value, path)
            return
        if f.type == FieldDescriptor.TYPE_ENUM:
            number = f.enum_type.values_by_name.get(str(value))
            if number is None:
                raise InvalidRequestError(path, f"{path} has no value {value!r}")
            setattr(msg, name, number.number)
            return
        integer = f.cpp_type in (
            FieldDescriptor.CPPTYPE_INT32,
            FieldDescriptor.CPPTYPE_INT64,
            FieldDescriptor.CPPTYPE_UINT32,
            FieldDescriptor.CPPTYPE_UINT64,
        )
        if isinstance(value, bool) or (integer and not isinstance(value, int)):
            raise InvalidRequestError(path, f"{path} must be an integer, got {value!r}")
        lo, hi = policy_fields.bounds(f)
        if not isinstance(value, (int, float)) or (
            (lo is not None and value < lo) or (hi is not None and value > hi)
        ):
            raise InvalidRequestError(
                path, f"{path} must be a number in [{lo}, {hi}], got {value!r}"
            )
        setattr(msg, name, value)
