"""The pipe between the gRPC process and its engine process: one dataclass per message.

``TO_ENGINE`` carries the parent's commands, ``FROM_ENGINE`` the engine's answers and reports
(``worker/wire.py``: JSON, no pickle). A call that waits for an answer (abort, a live change)
carries a ``token`` the answer repeats.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from gearshift.v1 import policy_pb2
from gearshift.worker.engine.contract import LiveValue
from gearshift.worker.engine.llm_engine import EngineStats
from gearshift.worker.engine.outputs import RequestOutput
from gearshift.worker.sampling.logprobs import TokenLogprobs
from gearshift.worker.sampling.params import SamplingParams
from gearshift.worker.wire import Codec

# ---- parent → engine -------------------------------------------------------------------------


@dataclass(frozen=True)
class AddRequest:
    """Admit a request; its outputs come back in ``Outputs``."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float


@dataclass(frozen=True)
class AbortRequest:
    """Abort a request; answered by ``Aborted``."""

    request_id: str
    token: int


@dataclass(frozen=True)
class ApplyLive:
    """Change the policy's live parameters; answered by ``LiveApplied`` or ``CallFailed``."""

    values: dict[str, LiveValue]
    token: int


@dataclass(frozen=True)
class StopEngine:
    """Stop the engine (aborting what runs) and end the process."""


Command = AddRequest | AbortRequest | ApplyLive | StopEngine

# ---- engine → parent -------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineReady:
    """The engine is built: its context length and its policy, defaults filled."""

    max_model_len: int
    policy: policy_pb2.Policy


@dataclass(frozen=True)
class StartFailed:
    """The engine could not be built (the process ends)."""

    message: str


class Refusal(enum.Enum):
    """How a request failed, so the parent raises the error the gRPC service maps."""

    INVALID = "invalid"  # InvalidRequestError: the request's own fault (field named)
    UNAVAILABLE = "unavailable"  # the group failed or the engine stopped
    FAILURE = "failure"  # anything else


@dataclass(frozen=True)
class RequestFailed:
    """A request ended with an error instead of an output."""

    request_id: str
    refusal: Refusal
    field: str
    message: str


@dataclass(frozen=True)
class Outputs:
    """One step's outputs (and failures), with the engine's stats after it."""

    items: list[RequestOutput | RequestFailed]
    stats: EngineStats
    dead: str | None


@dataclass(frozen=True)
class StatsReport:
    """The engine's stats between steps (every STATS_INTERVAL_S; silence means a hang)."""

    stats: EngineStats
    dead: str | None


@dataclass(frozen=True)
class Aborted:
    """The answer to ``AbortRequest``: whether the request was still running."""

    token: int
    found: bool


@dataclass(frozen=True)
class LiveApplied:
    """The answer to ``ApplyLive``: the policy now active."""

    token: int
    policy: policy_pb2.Policy


@dataclass(frozen=True)
class CallFailed:
    """A call was refused; ``field`` names the offending input (empty: not the caller's)."""

    token: int
    field: str
    message: str


@dataclass(frozen=True)
class EngineExit:
    """The engine has stopped; nothing follows."""


Event = (
    EngineReady
    | StartFailed
    | Outputs
    | StatsReport
    | Aborted
    | LiveApplied
    | CallFailed
    | EngineExit
)
Reply = Aborted | LiveApplied | CallFailed

TO_ENGINE: Codec[Command] = Codec((AddRequest, AbortRequest, ApplyLive, StopEngine))
FROM_ENGINE: Codec[Event] = Codec(
    (EngineReady, StartFailed, Outputs, StatsReport, Aborted, LiveApplied, CallFailed, EngineExit),
    # outputs.py names it only while type checking (it would pull torch into the router).
    {"TokenLogprobs": TokenLogprobs},
)
