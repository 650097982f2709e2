"""The router's control plane against token-checking fake workers: the control token on Admin
and on every worker call, streams cut off after the drain timeout, what clients see of errors."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest

from gearshift.operator.router import config as config_mod
from gearshift.operator.router.config import GroupSpec, RouterConfig
from gearshift.operator.router.server import RouterServer, load_tokenizer
from gearshift.v1 import policy_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from gearshift.worker.server import auth
from gearshift.worker.tokenizer import Tokenizer
from tests.router.fake_worker import FakeWorker, Script

TOKEN = auth.generate_token()
GOOD = (("authorization", f"Bearer {TOKEN}"),)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer("smollm2")


@dataclass
class Setup:
    workers: list[FakeWorker]
    server: RouterServer
    http: httpx.AsyncClient

    def address(self, which: str) -> str:
        assert self.server.ports is not None
        return f"127.0.0.1:{getattr(self.server.ports, which)}"


@contextlib.asynccontextmanager
async def running(
    tok: Tokenizer, router_token: str | None = TOKEN, **cfg: object
) -> AsyncIterator[Setup]:
    workers = [await FakeWorker(f"g{i}", token=TOKEN).start() for i in range(2)]
    config = RouterConfig(
        model_name="fake",
        model_path="smollm2",
        groups=tuple(GroupSpec(w.name, w.address) for w in workers),
        host="127.0.0.1",
        http_port=0,
        grpc_port=0,
        admin_host="127.0.0.1",
        admin_port=0,
        poll_interval_s=0.1,
        rpc_timeout_s=1.0,
        control_token=router_token,
        admin_token=TOKEN,
        insecure_no_auth=router_token is None,
        **cfg,  # type: ignore[arg-type]
    )
    server = RouterServer(config, tokenizer=tok)
    ports = await server.start()
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{ports.http}", timeout=20)
    try:
        yield Setup(workers, server, http)
    finally:
        await http.aclose()
        await server.stop(drain_timeout_s=1)
        for w in workers:
            await w.stop()


def run(tok: Tokenizer, scenario: Callable[[Setup], Awaitable[None]], **cfg: object) -> None:
    async def main() -> None:
        async with running(tok, **cfg) as setup:
            await scenario(setup)

    asyncio.run(asyncio.wait_for(main(), 90))


async def _wait_ready(s: Setup) -> None:
    for _ in range(100):
        if (await s.http.get("/ready")).status_code == 200:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the router never became ready")


def test_admin_refuses_calls_without_the_token_and_serves_those_with_it(
    tokenizer: Tokenizer,
) -> None:
    async def scenario(s: Setup) -> None:
        await _wait_ready(s)
        async with grpc.aio.insecure_channel(s.address("admin")) as channel:
            admin = router_pb2_grpc.AdminStub(channel)
            policy = policy_pb2.Policy(shift=policy_pb2.ShiftPolicy(threshold=64))
            calls = [
                lambda md: admin.GetStatus(router_pb2.GetStatusRequest(), metadata=md, timeout=5),
                lambda md: admin.Drain(router_pb2.DrainRequest(group="g0"), metadata=md, timeout=5),
                lambda md: admin.ApplyPolicy(
                    router_pb2.AdminApplyPolicyRequest(policy=policy), metadata=md, timeout=5
                ),
            ]
            for call in calls:
                for md in (None, (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await call(md)
                    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            # Nothing the refused calls asked for happened.
            assert all(w.threshold == 256 for w in s.workers)
            status = await calls[0](GOOD)
            assert {g.name for g in status.groups if g.serving and not g.draining} == {"g0", "g1"}
            # ApplyPolicy reaches the workers: the router presents the token to them.
            applied = await calls[2](GOOD)
            assert applied.applied and all(w.threshold == 64 for w in s.workers)
            drained = await calls[1](GOOD)
            assert drained.in_flight == 0
        # Requests flow through token-checking workers (Generate carries the token).
        for w in s.workers:
            w.script = Script(tokens=[9, 10, 11])
        r = await s.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3

    run(tokenizer, scenario)


def test_workers_refuse_a_router_without_the_token(tokenizer: Tokenizer) -> None:
    async def scenario(s: Setup) -> None:
        # The router has no token: its GetStats polls are refused, so no group ever serves.
        await asyncio.sleep(0.5)
        assert (await s.http.get("/ready")).status_code == 503
        async with grpc.aio.insecure_channel(s.workers[0].address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.GetStats(worker_pb2.GetStatsRequest(), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert (await stub.GetStats(worker_pb2.GetStatsRequest(), metadata=GOOD)).model
        # The reason is in the Admin status (for the operator), not in a client's answer.
        r = await s.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert r.status_code == 503
        assert "127.0.0.1" not in r.text and "UNAUTHENTICATED" not in r.text

    run(tokenizer, scenario, router_token=None)


def _events(body: str) -> list[dict]:
    lines = [ln[6:] for ln in body.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]", body[-300:]
    return [json.loads(ln) for ln in lines[:-1]]


def test_streams_running_past_the_drain_timeout_end_with_an_error_event_and_done(
    tokenizer: Tokenizer,
) -> None:
    async def main() -> None:
        async with running(tokenizer) as s:
            await _wait_ready(s)
            for w in s.workers:
                w.script = Script(tokens=list(range(100, 400)), delay_s=0.05)  # 15 s per stream

            async def sse(path: str, body: dict) -> str:
                async with s.http.stream("POST", path, json={**body, "stream": True}) as r:
                    assert r.status_code == 200
                    return (await r.aread()).decode()

            async def grpc_stream() -> grpc.StatusCode:
                async with grpc.aio.insecure_channel(s.address("grpc")) as channel:
                    call = router_pb2_grpc.GenerationStub(channel).Generate(
                        router_pb2.GenerateRequest(prompt="x", stream=True)
                    )
                    with pytest.raises(grpc.aio.AioRpcError) as cut:
                        async for _ in call:
                            pass
                    return cut.value.code()

            tasks = [
                asyncio.ensure_future(sse("/v1/completions", {"prompt": "x", "max_tokens": 300})),
                asyncio.ensure_future(
                    sse(
                        "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 300},
                    )
                ),
                asyncio.ensure_future(grpc_stream()),
            ]
            for _ in range(100):
                if s.server.router is not None and s.server.router.pool.in_flight == 3:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)  # some tokens streamed
            left = await s.server.router.drain(0.5)  # type: ignore[union-attr]
            assert left == 0
            completion, chat, code = await asyncio.wait_for(asyncio.gather(*tasks), 10)
            for body, kind in ((completion, "text_completion"), (chat, "chat.completion.chunk")):
                events = _events(body)
                assert events[0]["object"] == kind  # tokens came before the cut
                assert events[-1]["error"]["code"] == "service_unavailable"
                assert "drain timeout" in events[-1]["error"]["message"]
            assert code == grpc.StatusCode.UNAVAILABLE
            # The worker calls were cancelled, so the workers free the requests' KV (the
            # cancellations reach the workers asynchronously: wait for them, bounded).
            for _ in range(200):
                if sum(len(w.cancelled) for w in s.workers) == 3:
                    break
                await asyncio.sleep(0.05)
            assert sum(len(w.cancelled) for w in s.workers) == 3
            # After the drain, new requests are refused.
            r = await s.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
            assert r.status_code == 503

    asyncio.run(asyncio.wait_for(main(), 90))


def test_client_errors_hide_internal_addresses_and_truncate_echoed_input(
    tokenizer: Tokenizer,
) -> None:
    async def scenario(s: Setup) -> None:
        await _wait_ready(s)
        # A worker failing mid-stream with raw transport text: the client learns which group
        # failed, not the text (it goes to the router's log).
        for w in s.workers:
            w.script = Script(tokens=[1, 2, 3, 4], fail_after=2)
        r = await s.http.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 4, "stream": True}
        )
        last = _events(r.text)[-1]["error"]
        assert last["code"] == "worker_failed" and "scripted crash" not in last["message"]
        assert "127.0.0.1" not in r.text
        # 404 for an unknown model does not echo a megabyte back.
        huge = "m" * (1 << 20)
        r = await s.http.post("/v1/completions", json={"model": huge, "prompt": "x"})
        assert r.status_code == 404
        assert len(r.content) < 1000 and r.json()["error"]["code"] == "model_not_found"
        # 405 names the allowed methods.
        r = await s.http.get("/v1/completions")
        assert r.status_code == 405 and r.headers["allow"] == "POST"
        r = await s.http.delete("/v1/models")
        assert r.status_code == 405 and "GET" in r.headers["allow"]

    run(tokenizer, scenario)


def test_metrics_can_be_protected_by_the_api_key(tokenizer: Tokenizer) -> None:
    async def scenario(s: Setup) -> None:
        assert (await s.http.get("/metrics")).status_code == 401
        r = await s.http.get("/metrics", headers={"Authorization": "Bearer k1"})
        assert r.status_code == 200 and "gearshift_" in r.text
        assert (await s.http.get("/health")).status_code == 200  # probes stay open

    run(tokenizer, scenario, api_keys=("k1",), protect_metrics=True)


def test_router_json_names_the_token_file_and_protect_metrics(tmp_path: Path) -> None:
    """What the operator's router pod reads: the token file from the env (the Secret mount)."""
    token_file = auth.write_token(tmp_path / "token", "from-the-secret")
    path = tmp_path / "router.json"
    path.write_text(json.dumps({"model": {"name": "m", "path": "smollm2"}, "protectMetrics": True}))
    cfg = config_mod.from_file(path, {auth.TOKEN_FILE_ENV: str(token_file)})
    assert cfg.control_token == "from-the-secret" and cfg.protect_metrics
    assert config_mod.from_file(path, {}).control_token is None
    with pytest.raises(config_mod.ConfigError, match="controlTokenFile"):
        config_mod.from_file(path, {auth.TOKEN_FILE_ENV: str(tmp_path / "missing")})
