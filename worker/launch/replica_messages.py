"""The pipe between a replica group's host process and each replica's leading rank.

``TO_REPLICA`` carries the host's commands (``replicas.py``, ``server/replica_engine.py``),
``FROM_REPLICA`` what the replica answers and reports (``replica_rank.py``); one dataclass per
message, encoded without pickle (``worker/wire.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from gearshift.worker.engine.llm_engine import EngineStats
from gearshift.worker.engine.outputs import RequestOutput
from gearshift.worker.sampling.logprobs import TokenLogprobs
from gearshift.worker.sampling.params import SamplingParams
from gearshift.worker.wire import Codec

# ---- host → replica --------------------------------------------------------------------------


@dataclass(frozen=True)
class AddRequest:
    """Queue a request on this replica's engine."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class AbortRequest:
    """Abort a request (no answer: a served group's sink is already gone)."""

    request_id: str


@dataclass(frozen=True)
class GetStats:
    """Ask for ``ReplicaStats``: the engine's, the policy's and the replica sync's figures."""


@dataclass(frozen=True)
class GetSnapshot:
    """Ask for ``Snapshot``: the engine's stats only (a server's periodic poll)."""


@dataclass(frozen=True)
class StopReplica:
    """Finish what runs, stop together with the peers, answer ``Closed``."""


Command = AddRequest | AbortRequest | GetStats | GetSnapshot | StopReplica

# ---- replica → host --------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaReady:
    """The replica's engine is built."""

    num_blocks: int
    max_model_len: int


@dataclass(frozen=True)
class Finished:
    """A request ended (without ``stream``): every generated token and the finish reason."""

    request_id: str
    token_ids: list[int]
    reason: str


@dataclass(frozen=True)
class Refused:
    """The engine refused a request at admission (InvalidRequestError's text)."""

    request_id: str
    error: str


@dataclass(frozen=True)
class Output:
    """One step's output of a request (with ``stream``: a server's replicas)."""

    output: RequestOutput


@dataclass(frozen=True)
class ReplicaStats:
    """The answer to ``GetStats``."""

    policy: dict[str, float]
    # ReplicaSync.stats(): the policy's own figures, as JSON text (their shape is the policy's).
    sync_json: str
    engine: EngineStats


@dataclass(frozen=True)
class Snapshot:
    """The answer to ``GetSnapshot``."""

    engine: EngineStats


@dataclass(frozen=True)
class Closed:
    """The answer to ``StopReplica``: what the replica's KV blocks looked like at the end."""

    leaked_blocks: int
    all_free: bool


Event = ReplicaReady | Finished | Refused | Output | ReplicaStats | Snapshot | Closed

TO_REPLICA: Codec[Command] = Codec((AddRequest, AbortRequest, GetStats, GetSnapshot, StopReplica))
FROM_REPLICA: Codec[Event] = Codec(
    (ReplicaReady, Finished, Refused, Output, ReplicaStats, Snapshot, Closed),
    # outputs.py names it only while type checking (it would pull torch into the router).
    {"TokenLogprobs": TokenLogprobs},
)
