"""Preparation lanes (operator/router/lanes.py): small bodies in threads, large ones in real
processes with their own tokenizer, each lane bounded (429), admission before any of it, and
the bounded record of unknown fields."""

from __future__ import annotations

import asyncio
import json
import os
import time

import psutil
import pytest

from gearshift.operator.router import errors, request_prep
from gearshift.operator.router.lanes import LaneConfig, PreparationLanes
from gearshift.operator.router.limits import RequestLimits
from gearshift.operator.router.protocol import CompletionRequest
from gearshift.operator.router.request_params import IgnoredFields
from gearshift.operator.router.server import load_tokenizer
from gearshift.worker.tokenizer import Tokenizer
from tests.router.fake_worker import Script
from tests.router.test_router_routing import Setup, run

CTX = request_prep.PrepContext("fake", 512, RequestLimits())


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer("smollm2")


def _pid(tokenizer: Tokenizer, delay_s: float) -> int:
    """A preparation's stand-in: where it ran, after `delay_s` (picklable: module level)."""
    time.sleep(delay_s)
    return os.getpid()


def _children() -> set[int]:
    """Child processes, less multiprocessing's resource tracker (one per process, for life)."""
    return {
        p.pid
        for p in psutil.Process().children(recursive=True)
        if "resource_tracker" not in " ".join(p.cmdline())
    }


@pytest.mark.slow
def test_large_bodies_run_in_processes_that_end_with_the_lanes(tokenizer: Tokenizer) -> None:
    before = _children()
    lanes = PreparationLanes(LaneConfig(processes=1), tokenizer, "smollm2")

    async def main() -> None:
        assert await lanes.run(100, _pid, 0.0) == os.getpid()  # small: a thread here
        child = await lanes.run(1 << 20, _pid, 0.0)
        assert child != os.getpid() and child in _children()
        # The process's own tokenizer does the work, and refusals cross back whole.
        raw = json.dumps({"tokens": tokenizer.encode("hello world")}).encode()
        assert json.loads(await lanes.run(1 << 20, request_prep.detokenize, raw, CTX)) == {
            "prompt": "hello world"
        }
        with pytest.raises(errors.APIError) as info:
            await lanes.run(1 << 20, request_prep.detokenize, b"[" * 100_000, CTX)
        assert info.value.status == 400 and "nests deeper" in info.value.message

    try:
        asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        lanes.close()
    assert _children() - before == set(), "a preparation process outlived close()"


@pytest.mark.parametrize("size", [100, 1 << 20], ids=["small", "large"])
def test_a_full_lane_refuses_with_429(tokenizer: Tokenizer, size: int) -> None:
    # processes=0: both sizes take the thread lane, whose bound is the one under test; the
    # large lane's bound is the same code (_Lane.admit).
    config = LaneConfig(processes=0, threads=1, max_small=2)
    lanes = PreparationLanes(config, tokenizer, "smollm2")

    async def main() -> None:
        held = [asyncio.ensure_future(lanes.run(size, _pid, 0.5)) for _ in range(2)]
        await asyncio.sleep(0.05)
        assert lanes.held["small"] == 2
        with pytest.raises(errors.APIError) as info:
            await lanes.run(size, _pid, 0.0)
        assert info.value.status == 429 and info.value.retry_after is not None
        await asyncio.gather(*held)
        assert lanes.held["small"] == 0
        assert await lanes.run(size, _pid, 0.0) == os.getpid()

    try:
        asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        lanes.close()


@pytest.mark.slow
def test_a_body_is_prepared_alike_in_either_lane(tokenizer: Tokenizer) -> None:
    body = {"prompt": "hello " * 700, "max_tokens": 2, "stop": ["x"], "seed": 3}
    raw = json.dumps(body).encode()
    padded = raw + b" " * (20 << 10)  # the same JSON, past the small lane's size
    lanes = PreparationLanes(LaneConfig(processes=1), tokenizer, "smollm2")
    ctx = request_prep.PrepContext("fake", 4096, RequestLimits())

    async def main() -> None:
        assert lanes.lane_of(len(raw)) == "small" and lanes.lane_of(len(padded)) == "large"
        small = await lanes.run(len(raw), request_prep.completion, raw, ctx)
        large = await lanes.run(len(padded), request_prep.completion, padded, ctx)
        assert small.prompts == large.prompts == [tokenizer.encode(body["prompt"])]
        assert small.sampling == large.sampling and small.first == large.first
        assert isinstance(large.body, CompletionRequest) and large.body.stop == ["x"]

    try:
        asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        lanes.close()


def test_a_full_server_refuses_before_reading_the_body(tokenizer: Tokenizer) -> None:
    async def scenario(s: Setup) -> None:
        for w in s.workers:
            w.script = Script(tokens=list(range(100, 140)), delay_s=0.05)
        held = [asyncio.ensure_future(s.http.post("/v1/completions", json={"prompt": "x"}))]
        held.append(asyncio.ensure_future(s.http.post("/v1/completions", json={"prompt": "x"})))
        for _ in range(200):
            if s.server.router is not None and s.server.router.pool.in_flight == 2:
                break
            await asyncio.sleep(0.02)
        # Not valid JSON: a 400 had it been parsed; full, it is 429 before that.
        r = await s.http.post(
            "/v1/completions", content=b"{", headers={"content-type": "application/json"}
        )
        assert r.status_code == 429 and r.headers.get("retry-after"), r.text
        await asyncio.gather(*held)
        r = await s.http.post(
            "/v1/completions", content=b"{", headers={"content-type": "application/json"}
        )
        assert r.status_code == 400

    run(tokenizer, scenario, max_requests_per_group=1)


def test_the_record_of_unknown_fields_is_bounded() -> None:
    record = IgnoredFields(limit=8)
    for i in range(5):
        body = CompletionRequest.model_validate(
            {"prompt": "x", **{f"f{i}_{j}": 1 for j in range(4)}}
        )
        record.note(body)
    assert len(record.seen) == 8 and record.full
    record.note(CompletionRequest.model_validate({"prompt": "x", "f0_0": 1}))
    assert len(record.seen) == 8
