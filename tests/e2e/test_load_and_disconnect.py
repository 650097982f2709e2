"""Many concurrent streams, overload (429) and client disconnects against `gearshift serve`."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.e2e.conftest import API_KEY, MAX_REQUESTS_PER_GROUP, group_stats, status
from tests.e2e.serve_process import ServeProcess, wait_for

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


async def _stream(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[str, int]:
    body = {
        "model": "smollm2",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, usage = "", -1
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk["choices"]:
                text += chunk["choices"][0]["text"]
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
    return text, usage


def _idle(serve: ServeProcess) -> bool:
    for g in serve.info["groups"]:
        s = group_stats(serve, g["name"])
        if s.running or s.waiting or s.kv_blocks_used:
            return False
    return True


def _tokens_per_group(serve: ServeProcess) -> dict[str, int]:
    return {
        g["name"]: sum(x.tokens for x in group_stats(serve, g["name"]).gears)
        for g in serve.info["groups"]
    }


def test_64_concurrent_streams_complete_without_errors(serve: ServeProcess) -> None:
    before = _tokens_per_group(serve)

    async def main() -> list[tuple[str, int]]:
        async with httpx.AsyncClient(base_url=serve.url, headers=HEADERS, timeout=120) as c:
            return await asyncio.gather(*(_stream(c, f"Story number {i}:", 12) for i in range(64)))

    results = asyncio.run(asyncio.wait_for(main(), 240))
    assert len(results) == 64
    assert all(usage == 12 and text for text, usage in results)
    # Both groups took a share (least outstanding tokens spreads a burst).
    after = _tokens_per_group(serve)
    assert all(after[name] > before[name] for name in before), (before, after)
    wait_for(lambda: _idle(serve), 30, "groups idle with every KV block free")


def test_overload_answers_429_and_disconnects_free_every_block(serve: ServeProcess) -> None:
    capacity = 2 * MAX_REQUESTS_PER_GROUP
    long_body = {
        "model": "smollm2",
        "prompt": "Count forever:",
        "max_tokens": 1500,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }

    async def hold(c: httpx.AsyncClient, started: asyncio.Event) -> None:
        async with c.stream("POST", "/v1/completions", json=long_body) as r:
            started.set()
            async for _ in r.aiter_lines():
                pass

    def in_flight() -> int:
        return sum(g.stats.running + g.stats.waiting for g in status(serve).groups)

    async def main() -> httpx.Response:
        limits = httpx.Limits(max_connections=capacity + 8)
        async with httpx.AsyncClient(
            base_url=serve.url, headers=HEADERS, timeout=120, limits=limits
        ) as c:
            holders = [asyncio.create_task(hold(c, asyncio.Event())) for _ in range(capacity)]
            try:
                await asyncio.to_thread(wait_for, lambda: in_flight() >= capacity, 60, "full")
                extra = await c.post("/v1/completions", json={**long_body, "stream": False})
            finally:
                for task in holders:
                    task.cancel()  # the clients disconnect mid-request
                await asyncio.gather(*holders, return_exceptions=True)
            return extra

    extra = asyncio.run(asyncio.wait_for(main(), 180))
    assert extra.status_code == 429
    assert extra.headers["retry-after"] == "1"
    assert extra.json()["error"]["code"] == "rate_limit_exceeded"
    # Every disconnected request was aborted on its worker: no block stays allocated.
    wait_for(lambda: _idle(serve), 30, "groups idle with every KV block free")
    # And the server still serves.
    r = httpx.post(
        f"{serve.url}/v1/completions",
        headers=HEADERS,
        timeout=60,
        json={"model": "smollm2", "prompt": "Hi", "max_tokens": 2},
    )
    assert r.status_code == 200


@pytest.mark.parametrize("stream", [True, False])
def test_one_client_disconnecting_mid_request_frees_its_blocks(
    serve: ServeProcess, stream: bool
) -> None:
    body = {
        "model": "smollm2",
        "prompt": "Tell me everything:",
        "max_tokens": 1500,
        "ignore_eos": True,
        "temperature": 0,
        "stream": stream,
    }

    def used() -> int:
        return sum(group_stats(serve, g["name"]).kv_blocks_used for g in serve.info["groups"])

    async def main() -> None:
        async with httpx.AsyncClient(base_url=serve.url, headers=HEADERS, timeout=60) as c:
            task = asyncio.create_task(c.post("/v1/completions", json=body))
            await asyncio.to_thread(wait_for, lambda: used() > 0, 30, "blocks in use")
            await asyncio.sleep(0.5)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(asyncio.wait_for(main(), 90))
    wait_for(lambda: used() == 0, 30, "KV blocks freed after the disconnect")
