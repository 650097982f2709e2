"""A request no Tetris decode instance has room for waits in the router, oldest first, until a
stats poll reports room (operator/router/room_queue.py), as a serving engine queues what does
not fit its KV cache; only one that could never fit is refused at once (before: a 503 at once)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest
from grpc_health.v1 import health_pb2

from gearshift.operator.commands.router import add_router_args
from gearshift.operator.router import config as config_mod
from gearshift.operator.router.group import Group
from gearshift.operator.router.server import load_tokenizer
from gearshift.operator.router.tetris_requests import (
    TetrisNeverFits,
    TetrisNoRoom,
    TetrisRequestPlanner,
)
from gearshift.v1 import worker_pb2
from gearshift.worker.tokenizer import Tokenizer
from tests.router.fake_worker import FakeWorker, Script
from tests.router.test_router_routing import Setup, run
from tests.router.test_tetris_requests import _policy

PREFILL, DECODE = worker_pb2.InstanceStats.PREFILL, worker_pb2.InstanceStats.DECODE
BOUND_S = 10.0  # every wait below is bounded by this (a loaded machine's polls are slow)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer("smollm2")


def _instances(free: int, total: int = 1000) -> list[worker_pb2.InstanceStats]:
    """Four idle prefill instances and one decode instance with ``free`` KV slots of
    ``total`` (0: a worker that does not report what it holds)."""
    stats = worker_pb2.WorkerStats()
    for i in range(4):
        stats.instances.add(role=PREFILL, index=i, node=i // 2)
    stats.instances.add(role=DECODE, index=0, kv_slots_free=free, kv_slots_total=total)
    return list(stats.instances)


def _tetris(worker: FakeWorker, free: int, total: int = 1000) -> None:
    worker.script = Script(tokens=[100, 101])
    worker.policy = _policy()
    worker.instances = _instances(free, total)


def _group(s: Setup) -> Group:
    assert s.server.router is not None
    return s.server.router.pool.groups["g0"]


async def _until(check, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.02)


async def _waits(group: Group, pending: asyncio.Future[httpx.Response], in_flight: int) -> None:
    """Until the group holds ``in_flight`` requests, then: ``pending`` is still unanswered."""
    await _until(lambda: group.load.in_flight == in_flight or pending.done(), "it waits")
    assert not pending.done(), pending.result().text  # before: a 503 at once


async def _post(s: Setup, prompt_tokens: int) -> httpx.Response:
    return await s.http.post(
        "/v1/completions", json={"prompt": [7] * prompt_tokens, "max_tokens": 2}
    )


def test_the_planner_tells_not_yet_from_never_and_books_nothing_for_a_wait() -> None:
    planner = TetrisRequestPlanner()
    stats = worker_pb2.WorkerStats(policy=_policy())
    stats.instances.extend(_instances(100, 1000))
    with pytest.raises(TetrisNoRoom, match="no decode instance has 202 free KV slots"):
        planner.plan(stats, 200, 2)
    assert planner._rate is not None and not planner._rate._arrivals  # not counted yet
    with pytest.raises(TetrisNeverFits, match="holds more than 1000 even when empty"):
        planner.plan(stats, 1200, 2)
    # A decode instance that does not report what it holds (kv_slots_total 0) may fit it: wait.
    unknown = worker_pb2.WorkerStats(policy=_policy())
    unknown.instances.extend(_instances(100, 0))
    with pytest.raises(TetrisNoRoom):
        TetrisRequestPlanner().plan(unknown, 1200, 2)


def test_a_request_without_room_waits_then_completes_once_a_poll_reports_room(
    tokenizer: Tokenizer,
) -> None:
    async def scenario(s: Setup) -> None:
        worker = s.workers[0]
        _tetris(worker, free=100)
        await asyncio.sleep(0.3)  # a few stats polls
        pending = asyncio.ensure_future(_post(s, 200))  # 202 slots, 100 free
        group = _group(s)
        await _waits(group, pending, 1)
        await asyncio.sleep(0.4)  # several polls, still no room: it keeps waiting
        assert not pending.done() and worker.requests == []
        assert group.load.in_flight == 1  # it keeps its lease while it waits
        text = (await s.http.get("/metrics")).text
        assert 'gearshift_router_requests_queued{group="g0",model_name="fake"} 1.0' in text
        worker.instances = _instances(free=500)
        r = await asyncio.wait_for(pending, BOUND_S)
        assert r.status_code == 200, r.text
        assert len(worker.requests) == 1 and worker.requests[0].tetris_plan.decode_instance == 0
        assert len(group.room) == 0 and group.load.in_flight == 0

    run(tokenizer, scenario, groups=1)


def test_waiting_requests_get_room_oldest_first_even_past_a_smaller_later_one(
    tokenizer: Tokenizer,
) -> None:
    async def scenario(s: Setup) -> None:
        worker = s.workers[0]
        _tetris(worker, free=100)
        await asyncio.sleep(0.3)
        group = _group(s)
        older = asyncio.ensure_future(_post(s, 300))  # 302 slots: waits
        await _waits(group, older, 1)
        later = asyncio.ensure_future(_post(s, 50))  # 52 slots would fit the 100 free now
        await _waits(group, later, 2)  # it queues behind the older one
        await asyncio.sleep(0.4)
        assert worker.requests == [] and not later.done() and len(group.room) == 2
        worker.instances = _instances(free=400)
        a, b = await asyncio.wait_for(asyncio.gather(older, later), BOUND_S)
        assert a.status_code == 200 and b.status_code == 200, (a.text, b.text)
        assert [len(r.prompt_token_ids) for r in worker.requests] == [300, 50]

    run(tokenizer, scenario, groups=1)


def test_a_waiting_request_whose_client_leaves_holds_nothing(tokenizer: Tokenizer) -> None:
    async def scenario(s: Setup) -> None:
        worker = s.workers[0]
        _tetris(worker, free=100)
        await asyncio.sleep(0.3)
        group = _group(s)
        body = b'{"prompt": [' + b",".join([b"7"] * 200) + b'], "max_tokens": 2}'
        reader, writer = await asyncio.open_connection("127.0.0.1", s.server.ports.http)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()
        await _until(lambda: group.load.in_flight == 1, "the request is in flight")
        with pytest.raises(TimeoutError):  # no answer yet (before: a 503 at once)
            await asyncio.wait_for(reader.read(1), 0.4)
        assert group.load.in_flight == 1 and len(group.room) == 1
        writer.close()  # the client goes away
        await _until(lambda: group.load.in_flight == 0, "its lease is released")
        assert len(group.room) == 0
        worker.instances = _instances(free=500)  # room now: nothing is sent for it
        await asyncio.sleep(0.4)
        assert worker.requests == []
        assert (await _post(s, 200)).status_code == 200  # and the group takes the next one

    run(tokenizer, scenario, groups=1)


def test_the_wait_is_bounded_and_a_waiting_request_counts_against_the_group_limit(
    tokenizer: Tokenizer,
) -> None:
    async def scenario(s: Setup) -> None:
        worker = s.workers[0]
        _tetris(worker, free=100)
        await asyncio.sleep(0.3)
        group = _group(s)
        started = time.monotonic()
        pending = asyncio.ensure_future(_post(s, 200))
        await _waits(group, pending, 1)
        # max_requests_per_group 1: the waiting request holds the group's one place.
        full = await _post(s, 10)
        assert full.status_code == 429, full.text
        r = await asyncio.wait_for(pending, BOUND_S)
        assert r.status_code == 503, r.text
        assert time.monotonic() - started >= 1.0  # not before the bound
        assert r.json()["error"]["code"] == "queue_timeout" and "1 s" in r.text
        assert r.headers["Retry-After"] == "1"
        assert len(group.room) == 0 and group.load.in_flight == 0 and worker.requests == []

    run(tokenizer, scenario, groups=1, queue_timeout_s=1.0, max_requests_per_group=1)


def test_requests_waiting_on_a_group_that_stops_serving_go_elsewhere(
    tokenizer: Tokenizer,
) -> None:
    async def scenario(s: Setup) -> None:
        down, other = s.workers
        for w in s.workers:
            _tetris(w, free=100)
        await asyncio.sleep(0.3)
        pending = [asyncio.ensure_future(_post(s, 200)) for _ in range(2)]  # one per group
        groups = [s.server.router.pool.groups[w.name] for w in s.workers]  # type: ignore[union-attr]
        await _until(lambda: all(len(g.room) == 1 for g in groups), "both wait")
        other.instances = _instances(free=1000)  # room on the other group only
        await _until(lambda: other.requests, "the other group's request is sent")
        await down.health.set("gearshift.v1.Worker", health_pb2.HealthCheckResponse.NOT_SERVING)
        a, b = await asyncio.wait_for(asyncio.gather(*pending), BOUND_S)
        assert a.status_code == b.status_code == 200, (a.text, b.text)
        assert down.requests == [] and len(other.requests) == 2
        assert all(len(g.room) == 0 and g.load.in_flight == 0 for g in groups)

    run(tokenizer, scenario, groups=2)


def test_a_drain_cuts_off_a_waiting_request_at_its_timeout(tokenizer: Tokenizer) -> None:
    async def scenario(s: Setup) -> None:
        _tetris(s.workers[0], free=100)
        await asyncio.sleep(0.3)
        group = _group(s)
        pending = asyncio.ensure_future(_post(s, 200))
        await _waits(group, pending, 1)
        assert s.server.router is not None
        assert await s.server.router.drain(0.3, cut_off_wait_s=BOUND_S) == 0
        r = await asyncio.wait_for(pending, BOUND_S)
        assert r.status_code == 503 and "drain timeout" in r.text, r.text
        assert len(group.room) == 0 and group.load.in_flight == 0

    run(tokenizer, scenario, groups=1)


def test_a_request_no_decode_instance_could_ever_hold_is_refused_at_once(
    tokenizer: Tokenizer,
) -> None:
    async def scenario(s: Setup) -> None:
        worker = s.workers[0]
        _tetris(worker, free=100, total=150)
        await asyncio.sleep(0.3)
        started = time.monotonic()
        r = await _post(s, 200)  # 202 slots; the decode instance holds 150 when empty
        assert time.monotonic() - started < 1.0  # no wait (a poll is 0.1 s here)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "kv_capacity_exceeded" and error["param"] == "max_tokens"
        assert "needs 202 KV slots" in error["message"] and "150" in error["message"]
        assert len(_group(s).room) == 0 and _group(s).load.in_flight == 0
        assert worker.requests == []

    run(tokenizer, scenario, groups=1)


def test_the_wait_bound_is_a_router_setting(tmp_path: Path) -> None:
    path = tmp_path / "router.json"
    path.write_text(json.dumps({"model": {"name": "m", "path": "smollm2"}}))
    assert config_mod.from_file(path, env={}).queue_timeout_s == 600.0  # the default
    path.write_text(json.dumps({"model": {"name": "m"}, "queueTimeoutSeconds": 30}))
    assert config_mod.from_file(path, env={}).queue_timeout_s == 30.0
    for bad in (-1, "30", True):
        path.write_text(json.dumps({"model": {"name": "m"}, "queueTimeoutSeconds": bad}))
        with pytest.raises(config_mod.ConfigError, match="queueTimeoutSeconds"):
            config_mod.from_file(path, env={})
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    assert parser.parse_args(["--queue-timeout", "5"]).queue_timeout == 5.0
    assert parser.parse_args([]).queue_timeout is None  # router.json's (or 600 s) stands
