"""The Tetris group's control messages (launch/tetris/messages.py) on the typed pipe codec
(worker/wire.py): each direction's messages round-trip exactly, a message of another direction
or anything that is not a message is refused, and a link never unpickles what it receives."""

from __future__ import annotations

import multiprocessing
import os
import pickle
from pathlib import Path
from typing import Any

import pytest

from gearshift.worker.engine.llm_engine import EngineStats, InstanceLoad, ReplicaLoad
from gearshift.worker.engine.outputs import RequestMetrics, RequestOutput
from gearshift.worker.engine.sequence import FinishReason
from gearshift.worker.launch.tetris import messages as m
from gearshift.worker.launch.tetris.links import Link, member_link, pool_link
from gearshift.worker.policies.tetris.chunked_prefill import PlannedChunk
from gearshift.worker.sampling.logprobs import TokenLogprobs
from gearshift.worker.sampling.params import SamplingParams
from gearshift.worker.structured.grammar import GrammarSpec
from gearshift.worker.wire import WireError


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


PARAMS = SamplingParams(
    temperature=0.7,
    top_k=5,
    max_tokens=None,
    seed=2**40,
    stop=["\n\n", "END"],
    logprobs=3,
    logit_bias={7: -1.5, 11: 2.0},
    bad_words=[[3, 4], [5]],
    structured=GrammarSpec("choice", choices=("yes", "no")),
)
TOP = ((4, -0.25), (9, -1.5))
OUTPUT = RequestOutput(
    *("r1", [4, 9], "", True, FinishReason.STOP, "END", 12, 2, 4),
    RequestMetrics(1.0, 1.5, 2.0, None),
    new_logprobs=[TokenLogprobs(4, -0.25, 1, TOP), TokenLogprobs(9, -1.5, 2, TOP)],
)
STATS = EngineStats(
    *(1, 2, 64, 10, 10 / 64, 30, 0, 8, 100, 400, 90),
    gear_steps={"decode": 100},
    gear="decode",
    policy_stats={"admitted": 3.0},
    replicas=[ReplicaLoad(1, 2, 3)],
    instances=[InstanceLoad("prefill", 0, 1e9, 0, 0, 0, 1)],
)
CHUNKS = (PlannedChunk(1, (0,)), PlannedChunk(2, (0, 1)))
EVERY_MESSAGE = {
    m.HELLO: [m.Hello(3)],
    m.TO_POOL: [
        m.Prefill("r", (1, 2, 3), CHUNKS, ((0, 2),), (4,)),
        m.Go("r", 0, 1, 7),
        m.StreamGo("r", 1, 0, 8, 5, (4, 5)),
        m.Cancel("r"),
        m.Probe("p", CHUNKS[1:], 7),
        m.Stop(),
    ],
    m.FROM_POOL: [
        m.Loaded(128),
        m.Prefilled("r", 0.25),
        m.Offer("r", 2),
        m.WholeSent("r", 2, True),
        m.WholeUnsent("r", 2),
        m.StreamSent("r", 0, False, 3, 4),
        m.PrefillFailed("r", "prefill instance 1: Connection closed by peer"),
        m.Probed("p", (0.5, 0.75)),
        m.ProbeFailed("p", "ring peer died"),
        m.Closed(),
    ],
    m.TO_DECODE: [
        m.Expect("r", (5, 6), PARAMS, 3),
        m.Receive("r", 1, 9, 0, 1, 7),
        m.Post("r", 1, 9, 0, 0, 8),
        m.Complete("r", 1, 0, 8, True),
        m.Abort("r"),
        m.AskSnapshot(),
        m.Stop(),
    ],
    m.FROM_DECODE: [
        m.Loaded(128, 512),
        m.Output(OUTPUT),
        m.Landed("r", 1, 0),
        m.Refused("r", "max_tokens", "max_tokens too large"),
        m.TransferFailed("r", "the KV transfer from prefill rank 1 failed"),
        m.Snapshot(STATS, 40, 4),
        m.Closed(1, False, 2),
    ],
}


def test_every_message_round_trips_exactly_in_its_direction() -> None:
    for codec, messages in EVERY_MESSAGE.items():
        for msg in messages:
            got = codec.decode(codec.encode(msg))
            assert got == msg and type(got) is type(msg), msg
    expect = m.TO_DECODE.decode(m.TO_DECODE.encode(m.Expect("r", (1,), PARAMS, 1)))
    assert isinstance(expect, m.Expect) and expect.params.logit_bias == {7: -1.5, 11: 2.0}
    out = m.FROM_DECODE.decode(m.FROM_DECODE.encode(m.Output(OUTPUT)))
    assert isinstance(out, m.Output) and out.out.finish_reason is FinishReason.STOP


def test_a_message_of_another_direction_is_refused() -> None:
    with pytest.raises(WireError):
        m.FROM_POOL.decode(m.TO_POOL.encode(m.Go("r", 0, 0, 0)))  # a member never sends a grant
    with pytest.raises(WireError):
        m.TO_POOL.encode(m.Expect("r", (1,), PARAMS, 1))  # nor is a pool told to expect
    with pytest.raises(WireError):
        m.HELLO.decode(m.FROM_DECODE.encode(m.Loaded(1, 2)))


@pytest.mark.parametrize(
    "data",
    [
        pickle.dumps(m.Hello(1)),
        b'["Hello", true]',
        b'["Hello", "1"]',
        b'["Hello"]',
        b'["Hello", 1, 2]',
        b'["Evil", 1]',
        b'{"type": "Hello", "rank": 1}',
    ],
)
def test_anything_but_a_hello_is_refused_as_one(data: bytes) -> None:
    with pytest.raises(WireError):
        m.HELLO.decode(data)


def test_a_link_never_unpickles_what_it_receives(tmp_path: Path) -> None:
    payload, target = live_pickle(tmp_path)
    ours, theirs = multiprocessing.Pipe()
    link = pool_link(ours)
    try:
        theirs.send_bytes(payload)
        with pytest.raises(WireError):
            link.recv()
        assert not target.exists()
        member = member_link(theirs)
        member.send(m.Offer("r", 1))
        assert link.recv() == m.Offer("r", 1)
        link.send(m.Cancel("r"))
        assert member.recv() == m.Cancel("r")
    finally:
        ours.close()
        theirs.close()


def test_a_link_refuses_a_message_over_its_size_bound() -> None:
    ours, theirs = multiprocessing.Pipe()
    link = Link(ours, m.FROM_POOL, m.TO_POOL, max_bytes=64)
    try:
        member_link(theirs)  # the far end, unbounded
        theirs.send_bytes(m.TO_POOL.encode(m.Prefill("r", tuple(range(100)), (), (), ())))
        with pytest.raises(OSError):
            link.recv()
    finally:
        ours.close()
        theirs.close()
