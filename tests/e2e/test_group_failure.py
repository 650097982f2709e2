"""Killing worker groups under `gearshift serve`: failover, clear errors, readiness."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.serve_process import ServeProcess, wait_for

LONG = {
    "model": "smollm2",
    "prompt": "Count:",
    "max_tokens": 1500,
    "ignore_eos": True,
    "temperature": 0,
    "stream": True,
}


@pytest.fixture(scope="module")
def serve2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    proc = ServeProcess(
        tmp_path_factory.mktemp("serve-failover"),
        "--model",
        "smollm2",
        "--dtype",
        "bfloat16",
        "--groups",
        "2",
        "--max-num-seqs",
        "4",
        "--max-model-len",
        "2048",
        "--kv-cache-bytes",
        str(64 << 20),
        # Dead groups stay dead here (tests/e2e/test_recovery.py covers restarts).
        "--max-group-restarts",
        "0",
    )
    with proc:
        try:
            yield proc
        finally:
            assert proc.stop() == 0, proc.tail()
            assert proc.survivors() == []


async def _stream_events(client: httpx.AsyncClient, events: list[dict]) -> None:
    async with client.stream("POST", "/v1/completions", json=LONG) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))


def _kill_group(serve: ServeProcess, name: str) -> None:
    os.killpg(serve.worker_pid(name), signal.SIGKILL)


def _short(serve: ServeProcess) -> httpx.Response:
    return httpx.post(
        f"{serve.url}/v1/completions",
        timeout=60,
        json={"model": "smollm2", "prompt": "Hi", "max_tokens": 3},
    )


@pytest.mark.slow
def test_killing_groups_fails_over_then_reports_not_ready(serve2: ServeProcess) -> None:
    async def main() -> None:
        async with httpx.AsyncClient(base_url=serve2.url, timeout=120) as c:
            streams: list[list[dict]] = [[], []]
            tasks = [asyncio.create_task(_stream_events(c, ev)) for ev in streams]
            # Least outstanding tokens puts one long stream on each group.
            await asyncio.to_thread(
                wait_for, lambda: all(len(ev) > 2 for ev in streams), 60, "both streams running"
            )
            await asyncio.to_thread(_kill_group, serve2, "gearshift-g0")
            # The stream on the dead group ends with an error event, never a hang.
            done, _ = await asyncio.wait(tasks, timeout=30, return_when=asyncio.FIRST_COMPLETED)
            assert len(done) == 1, "the stream on the killed group did not end"
            dead = streams[tasks.index(next(iter(done)))]
            assert "error" in dead[-1] and "gearshift-g0" in dead[-1]["error"]["message"]
            live = tasks[1 - tasks.index(next(iter(done)))]
            assert not live.done()
            # /ready stays true and new requests (retried if they hit g0 first) all succeed.
            assert (await c.get("/ready")).status_code == 200
            for _ in range(4):
                r = await c.post(
                    "/v1/completions", json={"model": "smollm2", "prompt": "Hi", "max_tokens": 3}
                )
                assert r.status_code == 200, r.text
            # Kill the last group: its stream errors, /ready goes false, /health stays true.
            await asyncio.to_thread(_kill_group, serve2, "gearshift-g1")
            await asyncio.wait_for(live, 30)
            other = streams[tasks.index(live)]
            assert "error" in other[-1]

    asyncio.run(asyncio.wait_for(main(), 240))
    wait_for(
        lambda: httpx.get(f"{serve2.url}/ready", timeout=10).status_code == 503, 20, "/ready 503"
    )
    assert httpx.get(f"{serve2.url}/health", timeout=10).status_code == 200
    r = _short(serve2)
    assert r.status_code == 503 and r.json()["error"]["message"]
