"""Two 2-rank groups (pipeline stages) under `gearshift serve`: rank 0 of one is killed (the
group ends within 10 s with an error naming rank 0, the router fails over), then SIGTERM drains
the requests in flight on the other before serve exits."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import psutil
import pytest

from gearshift.v1 import router_pb2, router_pb2_grpc
from tests.e2e.serve_process import ServeProcess, named_descendants, wait_for

LONG = {
    "model": "smollm2",
    "prompt": "Count:",
    "max_tokens": 200,
    "ignore_eos": True,
    "temperature": 0,
    "stream": True,
}


RANKS = 2


def _serve3(tmp: Path, groups: int) -> ServeProcess:
    return ServeProcess(
        tmp,
        "--model",
        "smollm2",
        "--pp",
        "2",  # the cheapest multi-rank group for SmolLM2 (TP must divide its 3 KV heads)
        "--groups",
        str(groups),
        "--dtype",
        "bfloat16",
        "--max-num-seqs",
        "4",
        "--max-model-len",
        "512",
        "--kv-cache-bytes",
        str(32 << 20),
        "--drain-timeout",
        "240",
        start_timeout=480,
    )


@pytest.fixture(scope="module")
def serve3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    proc = _serve3(tmp_path_factory.mktemp("serve-tp3"), 2)
    with proc:
        try:
            yield proc
        finally:
            assert proc.stop(timeout=300) == 0, proc.tail()
            assert proc.survivors() == []


def _rank0(worker_pid: int) -> tuple[psutil.Process, list[psutil.Process]]:
    """The group leader's engine process (rank 0) and its follower ranks."""
    engines = named_descendants(worker_pid, "gs-engine")
    assert len(engines) == 1, f"{len(engines)} engine processes under worker {worker_pid}"
    followers = named_descendants(engines[0].pid, "gs-rank-")
    assert len(followers) == RANKS - 1, f"rank 0 has {len(followers)} followers"
    return engines[0], followers


async def _stream(client: httpx.AsyncClient, events: list[dict]) -> None:
    async with client.stream("POST", "/v1/completions", json=LONG) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))


def _status(serve: ServeProcess) -> dict[str, router_pb2.GroupStatus]:
    with grpc.insecure_channel(serve.admin_address) as channel:
        groups = (
            router_pb2_grpc.AdminStub(channel)
            .GetStatus(router_pb2.GetStatusRequest(), timeout=10, metadata=serve.metadata)
            .groups
        )
    return {g.name: g for g in groups}


@pytest.mark.slow
def test_killing_rank_0_ends_its_group_within_10s_naming_it_and_the_router_fails_over(
    serve3: ServeProcess,
) -> None:
    worker = psutil.Process(serve3.worker_pid("gearshift-g0"))
    leader, followers = _rank0(worker.pid)

    async def main() -> None:
        async with httpx.AsyncClient(base_url=serve3.url, timeout=300) as c:
            streams: list[list[dict]] = [[], []]
            tasks = [asyncio.create_task(_stream(c, ev)) for ev in streams]
            # Least outstanding tokens puts one long stream on each group.
            await asyncio.to_thread(
                wait_for, lambda: all(len(ev) > 2 for ev in streams), 120, "both streams"
            )
            killed_at = time.monotonic()
            leader.kill()
            _, alive = await asyncio.to_thread(psutil.wait_procs, [worker, *followers], timeout=10)
            assert not alive, f"still running {time.monotonic() - killed_at:.1f}s after: {alive}"
            # The dead group's stream ends with an error naming it. (On a fast CPU the other
            # stream may finish its 200 tokens meanwhile: which one ended first proves nothing.)
            await asyncio.to_thread(
                wait_for,
                lambda: any(ev and "error" in ev[-1] for ev in streams),
                30,
                "an error event on the dead group's stream",
            )
            dead_index = next(i for i, ev in enumerate(streams) if "error" in ev[-1])
            dead = streams[dead_index]
            assert "gearshift-g0" in dead[-1]["error"]["message"]
            await asyncio.wait_for(tasks[dead_index], 10)  # and the stream ended
            live = tasks[1 - dead_index]
            for _ in range(3):  # fail over: every new request is served (by g1)
                r = await c.post(
                    "/v1/completions", json={"model": "smollm2", "prompt": "Hi", "max_tokens": 3}
                )
                assert r.status_code == 200, r.text
            await asyncio.wait_for(live, 240)
            other = streams[tasks.index(live)]
            assert other[-1]["choices"][0]["finish_reason"] == "length"

    asyncio.run(asyncio.wait_for(main(), 420))
    log = serve3.tail(400_000)
    named = f"worker group failed: rank 0 (the group leader's engine process, pid {leader.pid})"
    assert named in log, log[-4000:]
    assert "worker group gearshift-g0 exited with code 1" in log
    # gearshift serve then restarts the dead group (as the operator would in a cluster).
    wait_for(
        lambda: "worker group gearshift-g0 is back (restart 1)" in serve3.tail(400_000),
        240,
        "g0 restarted",
    )
    assert _status(serve3)["gearshift-g1"].serving


@pytest.mark.slow
def test_sigterm_finishes_the_requests_in_flight_then_exits_0(tmp_path: Path) -> None:
    # A group of its own: the module's pair had its leader killed (and restarted) above.
    serve3 = _serve3(tmp_path, 1)
    with serve3:
        _drain_on_sigterm(serve3)


def _drain_on_sigterm(serve3: ServeProcess) -> None:
    assert serve3.proc is not None
    # Long enough to still be decoding after the SIGTERM on a fast CPU (48 tokens were done
    # before the probe on an AVX-512 machine, and the router had already exited).
    body = {"model": "smollm2", "prompt": "Count:", "max_tokens": 160, "ignore_eos": True}

    async def main() -> None:
        async with httpx.AsyncClient(base_url=serve3.url, timeout=300) as c:
            tasks = [asyncio.create_task(c.post("/v1/completions", json=body)) for _ in range(2)]

            def running() -> bool:
                return _status(serve3)["gearshift-g0"].stats.running == 2

            await asyncio.to_thread(wait_for, running, 120, "two requests running")
            await asyncio.sleep(0.5)  # decoding, not just admitted
            os.kill(serve3.proc.pid, signal.SIGTERM)
            await asyncio.sleep(0.3)
            refused = await c.post("/v1/completions", json=body)
            assert refused.status_code == 503, refused.text
            for r in await asyncio.gather(*tasks):
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["completion_tokens"] == body["max_tokens"]

    asyncio.run(asyncio.wait_for(main(), 300))
    assert serve3.proc.wait(120) == 0, serve3.tail()
