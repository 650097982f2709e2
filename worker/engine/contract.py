"""What the leader's engine asks of a policy each step (DESIGN.md: step contract).

The engine sits below the policies: it knows this interface, never a policy kind. The policy
packages (``worker/policies/``) implement it together with the rank-side half of the contract.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from gearshift.v1 import policy_pb2
    from gearshift.worker.engine.scheduler import ScheduledBatch

LiveValue = int | float | str


class StepKind(enum.Enum):
    """What a step may hold (a policy may separate prefill from decode, e.g. Seesaw §4.2)."""

    ANY = "any"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class StepRequest:
    """The policy's say in the next step, asked before the scheduler builds it."""

    kind: StepKind = StepKind.ANY
    max_seqs: int | None = None  # most sequences in this step (None: the scheduler's limit)


@dataclass(frozen=True)
class QueueView:
    """What the leader's queues hold when a step is about to be scheduled."""

    running: int
    waiting: int
    in_flight: int  # micro-batches submitted and not yet finished


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

    def to_proto(self) -> policy_pb2.Policy:
        """The active policy, live values included."""
        ...

    def update_live(self, values: dict[str, LiveValue]) -> None:
        """Apply live parameters (ApplyPolicy); refuses bad ones naming the field."""
        ...
