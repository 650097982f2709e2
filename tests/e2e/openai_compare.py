"""Send the same OpenAI requests to a router (openai-http group) and to its backend directly,
and compare the answers (greedy, so they must be equal)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from gearshift.operator.router.config import GroupSpec, RouterConfig
from gearshift.operator.router.server import RouterServer, load_tokenizer

SERVED = "served-name"
MESSAGES = [{"role": "user", "content": "Name three colours."}]
PROMPT = "The capital of France is"
CASES: list[tuple[str, dict[str, Any]]] = [
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


def strip(answer: dict[str, Any]) -> dict[str, Any]:
    """The answer without what differs per call by design (id, creation time, model name)."""
    return {k: v for k, v in answer.items() if k not in ("id", "created", "model")}


def chunks(text: str) -> list[dict[str, Any]]:
    lines = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", text[-500:]
    return [strip(json.loads(ln)) for ln in lines[:-1]]


def _merge(dst: dict[str, Any], src: dict[str, Any]) -> None:
    for key, value in src.items():
        if key == "choices":
            by_index = dst.setdefault("choices", {})
            for choice in value:
                _merge(by_index.setdefault(choice.get("index", 0), {}), choice)
        elif isinstance(value, dict):
            if not isinstance(dst.get(key), dict):
                dst[key] = {}
            _merge(dst[key], value)
        elif isinstance(value, list):
            dst[key] = (dst.get(key) or []) + value
        elif isinstance(value, str) and key in ("text", "content"):
            dst[key] = (dst.get(key) or "") + value
        elif value is not None or key not in dst:
            dst[key] = value


def merged(stream: list[dict[str, Any]]) -> dict[str, Any]:
    """A stream's chunks as one answer: texts and per-token lists joined, the rest last-wins.
    Where one stream's chunks end is timing (vLLM coalesces tokens a slow reader has not taken
    yet), so two streams of the same tokens are compared whole."""
    out: dict[str, Any] = {}
    for chunk in stream:
        _merge(out, chunk)
    return out


async def compare(backend_url: str, backend_model: str, max_model_len: int) -> str:
    """Every case, whole and streamed, through a router and directly; returns /metrics."""
    config = RouterConfig(
        model_name=SERVED,
        model_path="smollm2",
        groups=(GroupSpec("g0", backend_url),),
        host="127.0.0.1",
        http_port=0,
        grpc_port=None,
        admin_port=None,
        poll_interval_s=0.2,
        rpc_timeout_s=5.0,
        backend="openai-http",
        insecure_no_auth=True,  # no Admin here; the backend's key: test_openai_backend_key.py
    )
    server = RouterServer(config, tokenizer=load_tokenizer("smollm2"))
    ports = await server.start()
    router = httpx.AsyncClient(base_url=f"http://127.0.0.1:{ports.http}", timeout=300)
    direct = httpx.AsyncClient(base_url=backend_url, timeout=300)
    try:
        models = (await router.get("/v1/models")).json()
        assert models["data"][0]["id"] == SERVED
        assert models["data"][0]["max_model_len"] == max_model_len  # read from the backend
        for path, body in CASES:
            for stream in (False, True):
                sent = {**body, "stream": stream}
                ours = await router.post(path, json={**sent, "model": SERVED})
                theirs = await direct.post(path, json={**sent, "model": backend_model})
                assert ours.status_code == theirs.status_code == 200, ours.text
                if stream:
                    got, want = merged(chunks(ours.text)), merged(chunks(theirs.text))
                else:
                    got, want = strip(ours.json()), strip(theirs.json())
                    assert ours.json()["model"] == SERVED
                assert got == want, (path, sent, str(got)[:1500], str(want)[:1500])
                assert got, "empty answer"
        # A value the backend refuses comes back as its own 400.
        bad = {"prompt": PROMPT, "max_tokens": -1}
        ours = await router.post("/v1/completions", json={**bad, "model": SERVED})
        theirs = await direct.post("/v1/completions", json={**bad, "model": backend_model})
        assert ours.status_code == theirs.status_code == 400
        assert ours.json() == theirs.json()
        return (await router.get("/metrics")).text
    finally:
        await router.aclose()
        await direct.aclose()
        await server.stop(drain_timeout_s=1)


def success_count(metrics: str) -> float:
    lines = [ln for ln in metrics.splitlines() if ln.startswith("gearshift_request_success_total{")]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)


def run(backend_url: str, backend_model: str, max_model_len: int) -> str:
    return asyncio.run(asyncio.wait_for(compare(backend_url, backend_model, max_model_len), 900))
