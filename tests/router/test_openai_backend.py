"""The router's openai-http backend against scripted OpenAI servers on loopback: model names,
usage, retries before the first answer, load-based routing, refusals, metrics, polling."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest

from gearshift.operator.router import config as config_mod
from gearshift.operator.router.config import GroupSpec, RouterConfig
from gearshift.operator.router.openai_backend import OpenAIGroup
from gearshift.operator.router.server import RouterServer, load_tokenizer
from gearshift.v1 import router_pb2, router_pb2_grpc
from gearshift.worker.tokenizer import Tokenizer
from tests.router.fake_openai import FakeOpenAI, OpenAIScript


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer("smollm2")


@dataclass
class Setup:
    backends: list[FakeOpenAI]
    server: RouterServer
    http: httpx.AsyncClient


@contextlib.asynccontextmanager
async def running(
    tok: Tokenizer, backends: int, extra: tuple[str, ...] = (), api_keys: tuple[str, ...] = ()
) -> AsyncIterator[Setup]:
    fakes = [await FakeOpenAI().start() for _ in range(backends)]
    specs = [GroupSpec(f"v{i}", f.address) for i, f in enumerate(fakes)]
    specs += [GroupSpec(f"x{i}", a) for i, a in enumerate(extra)]
    config = RouterConfig(
        model_name="served",
        model_path="smollm2",
        groups=tuple(specs),
        host="127.0.0.1",
        http_port=0,
        grpc_port=0,
        admin_host="127.0.0.1",
        admin_port=0,
        poll_interval_s=0.1,
        rpc_timeout_s=1.0,
        drain_timeout_s=2.0,
        backend="openai-http",
        api_keys=api_keys,
        insecure_no_auth=True,  # no Admin token here; auth: test_router_control_plane.py
    )
    server = RouterServer(config, tokenizer=tok)
    ports = await server.start()
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{ports.http}", timeout=20)
    try:
        yield Setup(fakes, server, http)
    finally:
        await http.aclose()
        await server.stop(drain_timeout_s=1)
        for f in fakes:
            await f.stop()


def run(tok: Tokenizer, scenario: Callable[[Setup], Awaitable[None]], backends: int = 1) -> None:
    async def main() -> None:
        async with running(tok, backends) as setup:
            await scenario(setup)

    asyncio.run(asyncio.wait_for(main(), 180))  # a bound, generous for a loaded machine


def _sse(body: str) -> list[dict]:
    lines = [ln[6:] for ln in body.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_model_is_rewritten_both_ways_and_the_rest_forwarded_as_sent(tok: Tokenizer) -> None:
    async def scenario(s: Setup) -> None:
        (fake,) = s.backends
        r = await s.http.post("/v1/completions", json={"model": "served", "prompt": "hi"})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "served" and r.json()["choices"][0]["text"] == "Hello"
        assert fake.requests[-1]["model"] == "backend-model"

        r = await s.http.post(
            "/v1/chat/completions",
            json={
                "model": "served",
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
            },
        )
        chunks = _sse(r.text)
        # The body goes as the client sent it (vLLM moves fields when usage is asked for).
        assert "stream_options" not in fake.requests[-1]
        assert [c["choices"][0]["delta"]["content"] for c in chunks] == ["Hel", "lo"]
        assert all("usage" not in c and c["model"] == "served" for c in chunks)

        r = await s.http.post(
            "/v1/completions",
            json={"prompt": "hi", "stream": True, "stream_options": {"include_usage": True}},
        )
        chunks = _sse(r.text)
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2

    run(tok, scenario)


def test_wrong_model_is_404_and_backend_refusals_pass_through(tok: Tokenizer) -> None:
    async def scenario(s: Setup) -> None:
        (fake,) = s.backends
        r = await s.http.post("/v1/completions", json={"model": "other", "prompt": "hi"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        r = await s.http.post("/v1/completions", content=b"{not json")
        assert r.status_code == 400
        fake.script = OpenAIScript(status=400)
        r = await s.http.post("/v1/completions", json={"prompt": "hi", "best_of": 9})
        assert r.status_code == 400 and r.json()["error"]["message"] == "scripted 400"
        assert len(fake.requests) == 1  # a 400 is the backend's answer: not retried

    run(tok, scenario)


def test_a_group_failing_before_its_answer_is_retried_on_another(tok: Tokenizer) -> None:
    async def scenario(s: Setup) -> None:
        bad, good = s.backends
        bad.script = OpenAIScript(status=503)
        for stream in (False, True, False, True):
            r = await s.http.post("/v1/completions", json={"prompt": "hi", "stream": stream})
            assert r.status_code == 200, r.text
        assert bad.requests, "the failing group was never tried"
        metrics = (await s.http.get("/metrics")).text
        assert 'gearshift_request_retries_total{model_name="served"}' in metrics
        good.script = OpenAIScript(status=503)
        r = await s.http.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503

    run(tok, scenario, backends=2)


def test_unreachable_group_is_marked_down_and_skipped(tok: Tokenizer) -> None:
    async def scenario() -> None:
        # A port nothing listens on (bound, then closed).
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            dead = f"127.0.0.1:{sock.getsockname()[1]}"
        async with running(tok, 1, extra=(dead,)) as s:
            ready = (await s.http.get("/ready")).json()
            assert ready["serving_groups"] == ["v0"]
            for _ in range(3):
                r = await s.http.post("/v1/completions", json={"prompt": "hi"})
                assert r.status_code == 200, r.text

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_requests_go_to_the_least_loaded_group(tok: Tokenizer) -> None:
    async def scenario(s: Setup) -> None:
        gate = asyncio.Event()
        for f in s.backends:
            f.script = OpenAIScript(gate=gate)
        body = {"prompt": "hi", "max_tokens": 50, "stream": True}
        tasks = [asyncio.create_task(s.http.post("/v1/completions", json=body)) for _ in range(2)]
        for _ in range(200):
            if all(f.requests for f in s.backends):
                break
            await asyncio.sleep(0.02)
        assert [len(f.requests) for f in s.backends] == [1, 1]
        gate.set()
        for r in await asyncio.gather(*tasks):
            assert r.status_code == 200

    run(tok, scenario, backends=2)


def test_a_stream_cut_mid_way_ends_with_an_error_event(tok: Tokenizer) -> None:
    async def scenario(s: Setup) -> None:
        (fake,) = s.backends
        fake.script = OpenAIScript(pieces=["a", "b", "c"], drop_after=1)
        r = await s.http.post("/v1/completions", json={"prompt": "hi", "stream": True})
        chunks = _sse(r.text)
        assert chunks[0]["choices"][0]["text"] == "a"
        assert chunks[-1]["error"]["code"] == "worker_failed"

    run(tok, scenario)


def test_poll_reads_context_length_and_vllm_gauges(tok: Tokenizer) -> None:
    async def scenario(s: Setup) -> None:
        (fake,) = s.backends
        group = s.server.router.pool.get("v0") if s.server.router else None
        assert isinstance(group, OpenAIGroup) and group.stats is not None
        assert group.stats.max_model_len == 4096
        assert (group.stats.running, group.stats.waiting) == (3, 1)
        models = (await s.http.get("/v1/models")).json()
        assert models["data"][0]["id"] == "served"
        metrics = (await s.http.get("/metrics")).text
        assert 'gearshift_num_requests_running{group="v0",model_name="served"} 3.0' in metrics
        fake.healthy = False
        for _ in range(100):
            if not group.serving:
                break
            await asyncio.sleep(0.05)
        assert not group.serving and "503" in group.message
        assert (await s.http.post("/v1/completions", json={"prompt": "hi"})).status_code == 503

    run(tok, scenario)


def test_grpc_generate_is_refused_with_unimplemented(tok: Tokenizer) -> None:
    async def scenario(s: Setup) -> None:
        assert s.server.ports is not None
        address = f"127.0.0.1:{s.server.ports.grpc}"
        async with grpc.aio.insecure_channel(address) as channel:
            stub = router_pb2_grpc.GenerationStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.Generate(router_pb2.GenerateRequest(prompt="hi"), timeout=10):
                    pass
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "openai-http" in (info.value.details() or "")

    run(tok, scenario)


def test_router_json_accepts_openai_http_and_refuses_unknown_backends(tmp_path: Path) -> None:
    path = tmp_path / "router.json"
    path.write_text(json.dumps({"model": {"name": "m"}, "backend": "openai-http"}))
    assert config_mod.from_file(path, env={}).backend == "openai-http"
    path.write_text(json.dumps({"model": {"name": "m"}, "backend": "triton"}))
    with pytest.raises(config_mod.ConfigError, match="backend"):
        config_mod.from_file(path, env={})


def test_api_keys_are_checked_before_anything_is_forwarded(tok: Tokenizer) -> None:
    async def scenario() -> None:
        async with running(tok, 1, api_keys=("k1",)) as s:
            (fake,) = s.backends
            r = await s.http.post("/v1/completions", json={"prompt": "hi"})
            assert r.status_code == 401 and fake.requests == []
            auth = {"Authorization": "Bearer k1"}
            r = await s.http.post("/v1/completions", json={"prompt": "hi"}, headers=auth)
            assert r.status_code == 200 and len(fake.requests) == 1
            assert "authorization" not in fake.headers[0]  # the client's key stays here

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_client_leaving_before_the_first_token_frees_the_group(tok: Tokenizer) -> None:
    async def scenario(s: Setup) -> None:
        (fake,) = s.backends
        gate = asyncio.Event()  # opened only at the end: no first token before that
        fake.script = OpenAIScript(gate=gate)
        assert s.server.router is not None
        pool = s.server.router.pool
        for stream in (True, False):
            with pytest.raises(httpx.ReadTimeout):
                await s.http.post(
                    "/v1/completions", json={"prompt": "hi", "stream": stream}, timeout=0.5
                )
            for _ in range(200):
                if pool.in_flight == 0:
                    break
                await asyncio.sleep(0.05)
            assert pool.in_flight == 0, "the request still holds the group"
        gate.set()  # let the fake's own handlers finish so it can stop

    run(tok, scenario)
