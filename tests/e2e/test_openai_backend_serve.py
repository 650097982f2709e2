"""A router whose openai-http group is another `gearshift serve` (SmolLM2): its answers through
the router equal the backend's own (greedy; completions and chat; whole and streamed)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gearshift.operator.router.config import GroupSpec, RouterConfig
from gearshift.operator.router.server import RouterServer, load_tokenizer
from tests.e2e.serve_process import ServeProcess

SERVED = "smollm2"
MESSAGES = [{"role": "user", "content": "Name three colours."}]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    proc = ServeProcess(
        tmp_path_factory.mktemp("backend"),
        "--model",
        "smollm2",
        "--served-model-name",
        "smollm2-backend",
        "--dtype",
        "bfloat16",
        "--max-num-seqs",
        "4",
        "--max-model-len",
        "1024",
        "--kv-cache-bytes",
        str(32 << 20),
    )
    with proc:
        yield proc
    assert proc.survivors() == []


def _strip(answer: dict[str, Any]) -> dict[str, Any]:
    """The answer without what differs per call by design (id, creation time, model name)."""
    return {k: v for k, v in answer.items() if k not in ("id", "created", "model")}


def _chunks(text: str) -> list[dict[str, Any]]:
    lines = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", text[-500:]
    return [_strip(json.loads(ln)) for ln in lines[:-1]]


CASES = [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}),
    (
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 2, "stop": [","]},
    ),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 16, "temperature": 0}),
    (
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 16, "temperature": 0, "logprobs": True},
    ),
]


def test_answers_through_the_router_equal_the_backends_own(
    backend: ServeProcess, tmp_path: Path
) -> None:
    async def main() -> None:
        config = RouterConfig(
            model_name=SERVED,
            model_path="smollm2",
            groups=(GroupSpec("vllm-g0", backend.url),),
            host="127.0.0.1",
            http_port=0,
            grpc_port=None,
            admin_port=None,
            poll_interval_s=0.2,
            backend="openai-http",
        )
        server = RouterServer(config, tokenizer=load_tokenizer("smollm2"))
        ports = await server.start()
        router = httpx.AsyncClient(base_url=f"http://127.0.0.1:{ports.http}", timeout=120)
        direct = httpx.AsyncClient(base_url=backend.url, timeout=120)
        try:
            models = (await router.get("/v1/models")).json()
            assert models["data"][0]["id"] == SERVED
            assert models["data"][0]["max_model_len"] == 1024  # read from the backend
            for path, body in CASES:
                for stream in (False, True):
                    sent = {**body, "stream": stream}
                    ours = await router.post(path, json={**sent, "model": SERVED})
                    theirs = await direct.post(path, json={**sent, "model": "smollm2-backend"})
                    assert ours.status_code == theirs.status_code == 200, ours.text
                    if stream:
                        got, want = _chunks(ours.text), _chunks(theirs.text)
                    else:
                        got, want = _strip(ours.json()), _strip(theirs.json())
                        assert ours.json()["model"] == SERVED
                    assert got == want, (path, sent)
                    assert got, "empty answer"
            # A field the backend refuses comes back as its own 400.
            bad = {"prompt": PROMPT, "max_tokens": -1}
            ours = await router.post("/v1/completions", json=bad)
            theirs = await direct.post("/v1/completions", json=bad)
            assert ours.status_code == theirs.status_code == 400
            assert ours.json() == theirs.json()
            metrics = (await router.get("/metrics")).text
            success = [
                ln
                for ln in metrics.splitlines()
                if ln.startswith("gearshift_request_success_total{")
            ]
            assert sum(float(ln.rsplit(" ", 1)[1]) for ln in success) == 2 * len(CASES)
            assert "gearshift_time_to_first_token_seconds_count" in metrics
        finally:
            await router.aclose()
            await direct.aclose()
            await server.stop(drain_timeout_s=1)

    asyncio.run(asyncio.wait_for(main(), 300))
