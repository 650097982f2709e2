"""The HTTP API with the openai-http backend: a router (RouterServer, its loop in a thread of this
process) whose group is another `gearshift serve`. Schemathesis as for worker groups (no 5xx,
statuses and content types as documented, invalid bodies refused), and bad JSON (deep nesting,
lone surrogates) is a 400 from the router itself, never forwarded: through the proxy, nesting
used to be a 500 RecursionError.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from schemathesis import GenerationMode

from gearshift.operator.router.config import GroupSpec, RouterConfig
from gearshift.operator.router.server import RouterServer, load_tokenizer
from tests.e2e.conftest import API_KEY
from tests.e2e.serve_process import ServeProcess
from tests.e2e.test_schemathesis import fuzz
from tests.fuzz.background import Background

pytestmark = pytest.mark.slow

# Fewer than for worker groups: every valid case is a backend's generation too.
EXAMPLES_PER_OPERATION = 15


@contextlib.asynccontextmanager
async def _proxy(backend: ServeProcess) -> AsyncIterator[str]:
    config = RouterConfig(
        model_name="smollm2",
        model_path="smollm2",
        groups=(GroupSpec("g0", backend.url),),
        host="127.0.0.1",
        http_port=0,
        grpc_port=None,
        admin_port=None,
        poll_interval_s=0.2,
        rpc_timeout_s=5.0,
        backend="openai-http",
        api_keys=(API_KEY,),
    )
    server = RouterServer(config, tokenizer=load_tokenizer("smollm2"))
    ports = await server.start()
    try:
        yield f"http://127.0.0.1:{ports.http}"
    finally:
        await server.stop(drain_timeout_s=5)


@pytest.fixture(scope="module")
def proxy(openai_backend: ServeProcess) -> Iterator[str]:
    with Background(lambda: _proxy(openai_backend)) as url:
        yield url


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_generated_requests_through_the_proxy_never_get_a_5xx(
    proxy: str, mode: GenerationMode
) -> None:
    fuzz(proxy, mode, EXAMPLES_PER_OPERATION)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"prompt": ' + b"[" * 65 + b"]" * 65 + b"}",
        b'{"prompt": "a\\ud800b", "max_tokens": 2}',
        b'{"messages": [{"role": "user", "content": "\\ud83d"}]}',
    ],
    ids=["recursion", "deep", "surrogate", "surrogate-chat"],
)
def test_bad_json_through_the_proxy_is_400(proxy: str, raw: bytes) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    with httpx.Client(base_url=proxy, headers=headers, timeout=60) as client:
        for route in ("/v1/completions", "/v1/chat/completions"):
            r = client.post(route, content=raw)
            assert r.status_code == 400, (route, r.text)
        ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert ok.status_code == 200, ok.text
