"""The wire between processes (worker/wire.py): typed messages round-trip exactly, and anything
that is not one of a wire's messages (a pickle above all) is refused without being unpickled."""

from __future__ import annotations

import multiprocessing
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gearshift.worker.engine.llm_engine import EngineStats, InstanceLoad, ReplicaLoad
from gearshift.worker.engine.outputs import RequestMetrics, RequestOutput
from gearshift.worker.engine.sequence import FinishReason
from gearshift.worker.launch.tetris import messages as m
from gearshift.worker.policies.tetris.chunked_prefill import PlannedChunk
from gearshift.worker.sampling.logprobs import TokenLogprobs
from gearshift.worker.sampling.params import SamplingParams
from gearshift.worker.structured.grammar import GrammarSpec
from gearshift.worker.wire import Link, Wire, WireError


class Mkdir:
    """A pickle that makes a folder when it is loaded: proof that a receiver unpickled it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.path),))


def live_pickle(tmp_path: Path) -> tuple[bytes, Path]:
    """A pickle payload, shown to be live (loading a twin of it does make its folder)."""
    twin = tmp_path / "twin"
    pickle.loads(pickle.dumps(Mkdir(twin)))
    assert twin.is_dir()
    target = tmp_path / "made-by-unpickling"
    return pickle.dumps(Mkdir(target)), target


def _params() -> SamplingParams:
    return SamplingParams(
        temperature=0.7,
        top_k=5,
        max_tokens=None,
        seed=2**40,
        stop=["\n\n", "END"],
        stop_token_ids=[2],
        logprobs=3,
        logit_bias={7: -1.5, 11: 2.0},
        allowed_token_ids=[1, 7, 11],
        bad_words=[[3, 4], [5]],
        structured=GrammarSpec("choice", choices=("yes", "no")),
    )


def _output() -> RequestOutput:
    top = ((4, -0.25), (9, -1.5))
    return RequestOutput(
        "r1",
        [4, 9],
        "",
        True,
        FinishReason.STOP,
        "END",
        12,
        2,
        4,
        RequestMetrics(1.0, 1.5, 2.0, None),
        new_logprobs=[TokenLogprobs(4, -0.25, 1, top), TokenLogprobs(9, -1.5, 2, top)],
    )


def _stats() -> EngineStats:
    return EngineStats(
        *(1, 2, 64, 10, 10 / 64, 30, 0, 8, 100, 400, 90),
        gear_steps={"decode": 100},
        gear_tokens={"decode": 90},
        gear="decode",
        policy_stats={"admitted": 3.0},
        replicas=[ReplicaLoad(1, 2, 3)],
        instances=[InstanceLoad("prefill", 0, 1e9, 0, 0, 0, 1)],
    )


EVERY_MESSAGE = [
    m.Hello(3),
    m.Loaded(128, 512),
    m.Stop(),
    m.Closed(1, False, 2),
    m.Prefill("r", (1, 2, 3), (PlannedChunk(1, (0,)), PlannedChunk(2, (0, 1))), ((0, 2),), (4,)),
    m.Go("r", 0),
    m.StreamGo("r", 1, 1 << 24, 5, (4, 5)),
    m.Cancel("r"),
    m.Probe("p", (PlannedChunk(8, (1, 0)),), 7),
    m.Prefilled("r", 0.25),
    m.Offer("r", 2),
    m.WholeSent("r", 2, True),
    m.WholeUnsent("r", 2),
    m.StreamSent("r", 0, False, 3, 4),
    m.PrefillFailed("r", "prefill instance 1: Connection closed by peer"),
    m.Probed("p", (0.5, 0.75)),
    m.ProbeFailed("p", "ring peer died"),
    m.Expect("r", (5, 6), _params(), 3),
    m.Receive("r", 1, 9, 0),
    m.Post("r", 1, 9, 0, 1 << 24),
    m.Complete("r", 1, 0, 1 << 24, True),
    m.Abort("r"),
    m.AskSnapshot(),
    m.Output(_output()),
    m.Landed("r", 1),
    m.Refused("r", "max_tokens", "max_tokens too large"),
    m.TransferFailed("r", "the KV transfer from prefill rank 1 failed"),
    m.Snapshot(_stats(), 40, 4),
]


def test_every_tetris_message_round_trips_exactly() -> None:
    assert {type(x) for x in EVERY_MESSAGE} == set(m.WIRE.messages)
    for msg in EVERY_MESSAGE:
        got = m.WIRE.decode(m.WIRE.encode(msg))
        assert got == msg and type(got) is type(msg), msg
    params = m.WIRE.decode(m.WIRE.encode(m.Expect("r", (1,), _params(), 1)))
    assert isinstance(params, m.Expect)
    assert params.params.logit_bias == {7: -1.5, 11: 2.0}  # integer keys stay integers
    out = m.WIRE.decode(m.WIRE.encode(m.Output(_output())))
    assert isinstance(out, m.Output) and out.out.finish_reason is FinishReason.STOP


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"\x80\x05K\x01.", "not JSON"),
        (b"[1, 2]", "type and fields"),
        (b'{"type": "Evil", "fields": {}}', "unknown message type"),
        (b'{"type": "Hello", "fields": {}}', "fields"),
        (b'{"type": "Hello", "fields": {"rank": 1, "extra": 2}}', "fields"),
        (b'{"type": "Hello", "fields": {"rank": true}}', "integer"),
        (b'{"type": "Hello", "fields": {"rank": 1.0}}', "integer"),
        (b'{"type": "Hello", "fields": {"rank": "1"}}', "integer"),
        (b'{"type": "Go", "fields": {"rid": 5, "piece": 0}}', "str"),
        (
            b'{"type": "Probe", "fields": {"pid": "p", "chunks": [{"length": 1}], "seed": 0}}',
            "PlannedChunk",
        ),
        (b'{"type": "Loaded", "fields": {"num_blocks": 1}, "x": 1}', "type and fields"),
        (b"[" * 100_000 + b"]" * 100_000, "not JSON"),
    ],
)
def test_anything_but_a_known_message_is_refused(data: bytes, why: str) -> None:
    with pytest.raises(WireError, match=why):
        m.WIRE.decode(data)


def test_a_value_the_receiver_refuses_is_a_wire_error() -> None:
    # SamplingParams checks its fields when built: a decoded Expect is no exception.
    good = m.WIRE.encode(m.Expect("r", (1,), SamplingParams(), 1))
    with pytest.raises(WireError, match="top_p"):
        m.WIRE.decode(good.replace(b'"top_p":1.0', b'"top_p":7.0'))


def test_a_wire_refuses_types_it_cannot_carry_when_built() -> None:
    @dataclass(frozen=True)
    class Loose:
        value: Any

    @dataclass(frozen=True)
    class Inner:
        x: int

    @dataclass(frozen=True)
    class Outer:
        inner: Inner

    with pytest.raises(WireError, match="cannot carry"):
        Wire([Loose])
    with pytest.raises(WireError, match="must be named in nested"):
        Wire([Outer])
    with pytest.raises(WireError, match="not a dataclass"):
        Wire([int])
    wire = Wire([Outer], nested=[Inner])
    assert wire.decode(wire.encode(Outer(Inner(3)))) == Outer(Inner(3))
    with pytest.raises(WireError, match="not a message"):
        wire.encode(Inner(3))  # nested types are not messages on their own


def test_a_link_never_unpickles_what_it_receives(tmp_path: Path) -> None:
    payload, target = live_pickle(tmp_path)
    ours, theirs = multiprocessing.Pipe()
    link = Link(ours, m.WIRE)
    try:
        theirs.send_bytes(payload)
        with pytest.raises(WireError):
            link.recv()
        assert not target.exists()
        theirs.send_bytes(m.WIRE.encode(m.Go("r", 1)))
        assert link.recv() == m.Go("r", 1)
        link.send(m.Cancel("r"))
        assert m.WIRE.decode(theirs.recv_bytes()) == m.Cancel("r")
    finally:
        ours.close()
        theirs.close()


def test_a_link_refuses_a_message_over_its_size_bound() -> None:
    ours, theirs = multiprocessing.Pipe()
    link = Link(ours, m.WIRE, max_bytes=64)
    try:
        theirs.send_bytes(m.WIRE.encode(m.Prefill("r", tuple(range(100)), (), (), ())))
        with pytest.raises(OSError):
            link.recv()
    finally:
        ours.close()
        theirs.close()
