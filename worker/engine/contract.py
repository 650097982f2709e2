"""What the leader's engine asks of a policy each step (DESIGN.md: step contract).

The engine sits below the policies: it knows this interface, never a policy kind. The policy
packages (``worker/policies/``) implement it together with the rank-side half of the contract.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeAlias

if TYPE_CHECKING:
    import torch

    from gearshift.v1 import policy_pb2
    from gearshift.worker.engine.scheduler import ScheduledBatch, Scheduler
    from gearshift.worker.kv.block_manager import BlockManager

# One element of a repeated live field: a scalar, or a message's fields by proto name.
LiveItem = int | float | str | dict[str, int | float | str]
# A live field's value; a repeated field's is every element in order (an update replaces them).
LiveValue = int | float | str | tuple[LiveItem, ...]
# A plan section's int64 values as a policy hands them over: a tensor, or a list from a policy's
# leader half that runs without torch too (the simulator); the plan holds them as a tensor.
SectionValues: TypeAlias = "torch.Tensor | list[int]"


class StepKind(enum.Enum):
    """What a step may hold (a policy may separate prefill from decode, e.g. Seesaw §4.2)."""

    ANY = "any"
    PREFILL = "prefill"
    DECODE = "decode"
    NONE = "none"  # nothing new: let the steps in flight finish (e.g. before a re-shard)


@dataclass(frozen=True)
class StepRequest:
    """The policy's say in the next step, asked before the scheduler builds it."""

    kind: StepKind = StepKind.ANY
    max_seqs: int | None = None  # most sequences in this step (None: the scheduler's limit)
    # Most KV blocks the sequences this step admits may hold in all once prefilled, counted at
    # their whole length (None: no limit). A policy with a tier of its own (Seesaw's host
    # store) admits only what that tier can take, so nothing is recomputed for lack of room.
    admit_blocks: int | None = None


@dataclass(frozen=True)
class QueueView:
    """What the leader's queues hold when a step is about to be scheduled."""

    running: int
    waiting: int
    in_flight: int  # micro-batches submitted and not yet finished


def pipeline_share(queues: QueueView, stages: int) -> StepRequest:
    """A pipeline's step: each micro-batch takes its 1/``stages`` share of the active sequences,
    so that every stage has work (Seesaw §5.1 / vLLM's virtual engines). The static policy asks
    this of its scheduler, and the simulator of its pipelines (no torch here)."""
    if stages <= 1:
        return StepRequest()
    active = queues.running + queues.waiting
    return StepRequest(max_seqs=max(1, -(-active // stages)))


class ReplicaSync(Protocol):
    """How one engine replica of a multi-replica group meets its peers at step boundaries (a
    policy's, e.g. a group-wide mode that must change at the same step everywhere)."""

    def before_step(self, num_tokens: int) -> None:
        """Called before each step this replica runs (``num_tokens``: its scheduled tokens)."""
        ...

    def idle(self, stopping: bool) -> IdleResult:
        """Called while the replica has nothing to run (``stopping``: it was asked to end)."""
        ...

    def stats(self) -> dict[str, object]: ...


class IdleResult(enum.Enum):
    """What an idle replica's call to ``ReplicaSync.idle`` found."""

    BUSY = "busy"  # the group is stepping (this replica ran a dummy step): call again at once
    WAIT = "wait"  # nothing to do: wait a little (or for work) before calling again
    STOP = "stop"  # every replica is stopping: leave the loop now


class LeaderPolicy(Protocol):
    """The leader-side half of a policy."""

    gear_names: tuple[str, ...]

    @property
    def kind(self) -> str: ...

    def micro_batches(self) -> int: ...

    def step_request(self, queues: QueueView) -> StepRequest: ...

    def choose_gear(self, batch: ScheduledBatch) -> int: ...

    def pad_multiple(self, gear: int) -> int: ...

    def stats(self) -> dict[str, float]: ...

    def bind(self, scheduler: Scheduler, blocks: BlockManager) -> None:
        """Called once by the engine: a policy that moves KV between tiers needs both."""
        ...

    def held(self) -> frozenset[str]:
        """Request ids the scheduler must leave alone this step (their KV is not on the
        device yet, e.g. in a host tier): neither scheduled nor preempted."""
        ...

    def plan_sections(self, batch: ScheduledBatch) -> Mapping[str, SectionValues]:
        """Sections for the next plan (e.g. KV swaps every rank performs before its forward);
        the engine ships a plan without tokens when the batch is empty and sections are not."""
        ...

    def step_submitted(self) -> None:
        """The plan holding the last ``plan_sections`` was handed to every rank."""
        ...

    def to_proto(self) -> policy_pb2.Policy:
        """The active policy, live values included."""
        ...

    def update_live(self, values: dict[str, LiveValue]) -> None:
        """Apply live parameters (ApplyPolicy); refuses bad ones naming the field."""
        ...
