"""The typed pipe codec: every message of both engine protocols round-trips, and anything that
is not one of them is refused, naming what is wrong (never unpickled)."""

from __future__ import annotations

import json
import math
import multiprocessing
import pickle
import re
from dataclasses import dataclass
from typing import Any

import pytest

from gearshift.v1 import policy_pb2
from gearshift.worker.engine.llm_engine import EngineStats, InstanceLoad, ReplicaLoad
from gearshift.worker.engine.outputs import RequestMetrics, RequestOutput
from gearshift.worker.engine.sequence import FinishReason
from gearshift.worker.launch import replica_messages as rm
from gearshift.worker.sampling.logprobs import TokenLogprobs
from gearshift.worker.sampling.params import SamplingParams
from gearshift.worker.server import engine_messages as em
from gearshift.worker.structured.grammar import GrammarSpec
from gearshift.worker.wire import Codec, WireError

PARAMS = SamplingParams(
    max_tokens=None,
    temperature=0.7,
    seed=-3,
    stop=["\n\n", "END"],
    stop_token_ids=[2],
    logprobs=2,
    logit_bias={7: -100.0, 9: 2.5},
    allowed_token_ids=[1, 2, 7, 9],
    bad_words=[[3, 4], [5]],
    structured=GrammarSpec("choice", choices=("yes", "no")),
    prompt_logprobs=1,
)
POLICY = policy_pb2.Policy()
POLICY.shift.threshold = 256
OUTPUT = RequestOutput(
    request_id="r-1",
    new_token_ids=[9],
    new_text=" é\U0001f600",
    finished=True,
    finish_reason=FinishReason.STOP,
    stop_reason="END",
    num_prompt_tokens=3,
    num_output_tokens=4,
    num_cached_tokens=0,
    metrics=RequestMetrics(1.5, 2.0, 2.25, None),
    new_logprobs=[TokenLogprobs(9, -math.inf, 3, ((7, -0.5), (1, -1.0)))],
    prompt_logprobs=[TokenLogprobs(2, -0.25, 1, ())],
)
STATS = EngineStats(
    *(1, 2, 64, 10, 10 / 64, 30, 0, 16, 5, 40, 12),
    gear_steps={"base": 3, "shift": 2},
    gear_tokens={"base": 30},
    gear="shift",
    policy_stats={"sidp_mode": 2.0},
    replicas=[ReplicaLoad(1, 0, 7)],
    instances=[InstanceLoad("prefill", 0, 0.5, 0, 0, 0, node=1)],
)
ENGINE_COMMANDS = [
    em.AddRequest("r-1", [1, 2, 3], PARAMS, 12.5),
    em.AbortRequest("r-1", 4),
    em.ApplyLive({"shift.threshold": 128, "ratio": 0.5, "mode": "cas"}, 5),
    em.StopEngine(),
]
ENGINE_EVENTS = [
    em.EngineReady(2048, POLICY),
    em.StartFailed("ModelLoadError: no such file"),
    em.Outputs([OUTPUT, em.RequestFailed("r-2", em.Refusal.INVALID, "top_k", "bad")], STATS, None),
    em.StatsReport(STATS, "rank 1 exited"),
    em.Aborted(4, True),
    em.LiveApplied(5, POLICY),
    em.CallFailed(6, "shift.threshold", "must be >= 0"),
    em.EngineExit(),
]
REPLICA_COMMANDS = [
    rm.AddRequest("r-1", [1, 2], SamplingParams()),
    rm.AbortRequest("r-1"),
    rm.GetStats(),
    rm.GetSnapshot(),
    rm.StopReplica(),
]
REPLICA_EVENTS = [
    rm.ReplicaReady(100, 512),
    rm.Finished("r-1", [4, 5], "length"),
    rm.Refused("r-2", "prompt: too long"),
    rm.Output(OUTPUT),
    rm.ReplicaStats({"sidp_mode": 3.0}, json.dumps({"tags": [[1, 2, 3]]}), STATS),
    rm.Snapshot(STATS),
    rm.Closed(0, True),
]
CASES = [
    *((em.TO_ENGINE, m) for m in ENGINE_COMMANDS),
    *((em.FROM_ENGINE, m) for m in ENGINE_EVENTS),
    *((rm.TO_REPLICA, m) for m in REPLICA_COMMANDS),
    *((rm.FROM_REPLICA, m) for m in REPLICA_EVENTS),
]


def _same(a: Any, b: Any) -> bool:
    """Equality that also holds for -inf logprobs and NaN-free floats, type for type."""
    return type(a) is type(b) and repr(a) == repr(b)


@pytest.mark.parametrize(("codec", "message"), CASES, ids=lambda v: type(v).__name__)
def test_every_message_round_trips_to_an_equal_message_of_the_same_types(
    codec: Codec[Any], message: Any
) -> None:
    back = codec.decode(codec.encode(message))
    assert _same(back, message)
    if isinstance(message, em.AddRequest):
        # Tuples stay tuples and int keys stay ints: the engine sees what it was sent.
        assert back.params.logit_bias == {7: -100.0, 9: 2.5}
        assert back.params.bad_words == ((3, 4), (5,))


def test_every_protocol_lists_each_of_its_messages() -> None:
    # A message class missing from its codec could not be sent; one test per class above.
    for module, cases in (
        (em, ENGINE_COMMANDS + ENGINE_EVENTS),
        (rm, REPLICA_COMMANDS + REPLICA_EVENTS),
    ):
        declared = {
            name
            for name, value in vars(module).items()
            if isinstance(value, type)
            and value.__module__ == module.__name__
            and hasattr(value, "__dataclass_fields__")
            and name != "RequestFailed"
        }
        assert declared == {type(m).__name__ for m in cases}


def test_the_pipe_carries_json_not_pickle() -> None:
    parent, child = multiprocessing.Pipe()
    try:
        em.TO_ENGINE.send(parent, ENGINE_COMMANDS[0])
        raw = child.recv_bytes()
        assert json.loads(raw)[0] == "AddRequest"
        em.TO_ENGINE.send(parent, ENGINE_COMMANDS[1])
        assert em.TO_ENGINE.recv(child) == ENGINE_COMMANDS[1]
    finally:
        parent.close()
        child.close()


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (pickle.dumps(ENGINE_COMMANDS[1]), "not a message"),
        (b"", "not a message"),
        (b'{"AbortRequest": 1}', "not a message of this protocol"),
        (b'["Outputs", [], null, null]', "not a message of this protocol"),  # other direction
        (b'["SamplingParams"]', "not a message of this protocol"),  # a payload, not a message
        (b'["AbortRequest", "r"]', "expected a AbortRequest"),
        (b'["AbortRequest", "r", "4"]', "AbortRequest.token: expected int, got '4'"),
        (b'["AbortRequest", "r", true]', "AbortRequest.token: expected int, got True"),
        (b'["ApplyLive", {"x": [[1]]}, 1]', "ApplyLive.values"),
        (b'["AddRequest", "r", [1, 2.5], null, 0]', "AddRequest.prompt_token_ids"),
    ],
)
def test_decode_refuses_what_is_not_a_message_naming_the_field(data: bytes, words: str) -> None:
    with pytest.raises(WireError, match=re.escape(words)):
        em.TO_ENGINE.decode(data)


def test_decoding_runs_the_dataclass_checks() -> None:
    tree = json.loads(em.TO_ENGINE.encode(ENGINE_COMMANDS[0]))
    tree[3][4] = -1.0  # SamplingParams.temperature
    with pytest.raises(WireError, match="temperature must be >= 0"):
        em.TO_ENGINE.decode(json.dumps(tree).encode())


def test_encode_refuses_other_types_instead_of_changing_them() -> None:
    with pytest.raises(WireError, match="not a message of this protocol"):
        em.TO_ENGINE.encode(em.EngineExit())  # type: ignore[arg-type]
    with pytest.raises(WireError, match="string keys"):
        em.TO_ENGINE.encode(em.ApplyLive({1: 2}, 0))  # type: ignore[dict-item]
    with pytest.raises(WireError, match=re.escape("expected RequestOutput | RequestFailed")):
        em.FROM_ENGINE.encode(em.Outputs([object()], STATS, None))  # type: ignore[list-item]
    with pytest.raises(WireError, match="AddRequest"):
        em.TO_ENGINE.encode(em.AddRequest("r", [object()], PARAMS, 0.0))  # type: ignore[list-item]


@dataclass(frozen=True)
class _Loose:
    value: Any


@dataclass(frozen=True)
class _Ambiguous:
    value: list[int] | tuple[str, ...]


@dataclass(frozen=True)
class _Plain:
    value: object


@pytest.mark.parametrize("cls", [_Loose, _Ambiguous, _Plain])
def test_a_codec_refuses_fields_it_could_not_check(cls: type) -> None:
    with pytest.raises(TypeError, match="wire codec cannot"):
        Codec([cls])


@dataclass(frozen=True)
class _Blob:
    data: bytes
    maybe: bytes | None


def test_bytes_travel_as_base64_and_anything_else_is_refused() -> None:
    codec: Codec[_Blob] = Codec([_Blob])
    raw = bytes(range(256))
    assert codec.decode(codec.encode(_Blob(raw, None))) == _Blob(raw, None)
    assert codec.decode(codec.encode(_Blob(b"", b"\x00"))) == _Blob(b"", b"\x00")
    for bad in ('["_Blob", "not base64!", null]', '["_Blob", [1, 2], null]', '["_Blob", 7, null]'):
        with pytest.raises(WireError, match=re.escape("_Blob.data: expected base64 bytes")):
            codec.decode(bad.encode())
    with pytest.raises(WireError, match="expected bytes"):
        codec.encode(_Blob("text", None))  # type: ignore[arg-type]


def test_nesting_too_deep_for_the_parser_is_refused_not_raised() -> None:
    with pytest.raises(WireError, match="not a message"):
        em.TO_ENGINE.decode(b"[" * 200_000 + b"]" * 200_000)
