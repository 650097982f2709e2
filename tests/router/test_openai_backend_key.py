"""The openai-http backend authenticates to its servers (issue 31, item 7): `engine: vllm` pods
take the deployment's control token as their API key, and the router sends it on every call,
polls included; never the client's own key; after a rotation, the old token once more for a
server started before it."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import httpx
import pytest

from gearshift.operator.router.config import GroupSpec, RouterConfig
from gearshift.operator.router.server import RouterServer, load_tokenizer
from gearshift.worker.server import auth
from gearshift.worker.tokenizer import Tokenizer
from tests.router.fake_openai import FakeOpenAI


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer("smollm2")


async def _until(predicate: object, what: str, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


def _router(fake: FakeOpenAI, token_file: Path | None, tok: Tokenizer) -> RouterServer:
    config = RouterConfig(
        model_name="served",
        model_path="smollm2",
        groups=(GroupSpec("v0", fake.address),),
        host="127.0.0.1",
        http_port=0,
        grpc_port=None,
        admin_port=None,
        poll_interval_s=0.1,
        rpc_timeout_s=2.0,
        backend="openai-http",
        api_keys=("client-key",),
        control_token=auth.read_token(token_file) if token_file else None,
        control_token_file=token_file,
    )
    return RouterServer(config, tokenizer=tok)


def test_the_router_sends_the_control_token_to_a_keyed_server_and_never_the_clients_key(
    tok: Tokenizer, tmp_path: Path
) -> None:
    token_file = auth.write_token(tmp_path / "token", "control-1")

    async def main() -> None:
        fake = await FakeOpenAI().start()
        fake.api_key = "control-1"
        server = _router(fake, token_file, tok)
        ports = await server.start()
        http = httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{ports.http}",
            headers={"Authorization": "Bearer client-key"},
            timeout=20,
        )

        async def ready() -> bool:
            return (await http.get("/ready")).status_code == 200

        try:
            await _until(ready, "the keyed server polled as up")
            assert fake.model_headers[-1]["authorization"] == "Bearer control-1"
            for stream in (False, True):
                r = await http.post("/v1/completions", json={"prompt": "hi", "stream": stream})
                assert r.status_code == 200, r.text
                assert fake.headers[-1]["authorization"] == "Bearer control-1"
            assert all("client-key" not in str(h) for h in fake.headers + fake.model_headers)

            # A rotation reaches the router first: its new token is refused by the server that
            # started with the old one, which the router then presents (once, in the window).
            tmp = token_file.with_name(".token.new")
            tmp.write_text("control-2")
            os.replace(tmp, token_file)
            await asyncio.sleep(1.5)  # past the recheck interval
            sent = len(fake.headers)
            r = await http.post("/v1/completions", json={"prompt": "hi"})
            assert r.status_code == 200, r.text
            tried = [h["authorization"] for h in fake.headers[sent:]]
            assert tried == ["Bearer control-2", "Bearer control-1"]
            # The group rolled: its new pods take the new token, sent first.
            fake.api_key = "control-2"
            sent = len(fake.headers)
            r = await http.post("/v1/completions", json={"prompt": "hi"})
            assert r.status_code == 200
            assert [h["authorization"] for h in fake.headers[sent:]] == ["Bearer control-2"]
        finally:
            await http.aclose()
            await server.stop(drain_timeout_s=1)
            await fake.stop()

    asyncio.run(asyncio.wait_for(main(), 90))


def test_without_the_key_a_keyed_server_is_never_counted_up(tok: Tokenizer) -> None:
    async def main() -> None:
        fake = await FakeOpenAI().start()
        fake.api_key = "control-1"
        server = _router(fake, None, tok)
        ports = await server.start()
        http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{ports.http}", timeout=20)
        try:
            await asyncio.sleep(0.5)
            assert (await http.get("/ready")).status_code == 503
            assert "authorization" not in fake.model_headers[-1]
            assert server.router is not None
            assert "401" in server.router.pool.groups["v0"].message
        finally:
            await http.aclose()
            await server.stop(drain_timeout_s=1)
            await fake.stop()

    asyncio.run(asyncio.wait_for(main(), 90))
