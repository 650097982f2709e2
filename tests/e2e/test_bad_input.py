"""Bad input gets OpenAI-style error JSON with the right status, and breaks nothing."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import API_KEY, group_stats
from tests.e2e.serve_process import ServeProcess, wait_for

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    return dict(error)


def _post(serve: ServeProcess, path: str, **kw: Any) -> httpx.Response:
    kw.setdefault("headers", HEADERS)
    return httpx.post(f"{serve.url}{path}", timeout=60, **kw)


def test_malformed_json_is_400(serve: ServeProcess) -> None:
    r = _post(
        serve,
        "/v1/completions",
        content=b'{"prompt": "hi",',
        headers={**HEADERS, "content-type": "application/json"},
    )
    assert "JSON" in _error(r, 400)["message"]


def test_unknown_model_is_404(serve: ServeProcess) -> None:
    r = _post(
        serve,
        "/v1/chat/completions",
        json={"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert _error(r, 404)["code"] == "model_not_found"


@pytest.mark.parametrize(
    ("field", "value"), [("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5)]
)
def test_out_of_range_sampling_values_are_400_naming_the_field(
    serve: ServeProcess, field: str, value: float
) -> None:
    r = _post(serve, "/v1/completions", json={"model": "smollm2", "prompt": "hi", field: value})
    assert _error(r, 400)["param"] == field


def test_max_tokens_beyond_the_context_is_400(serve: ServeProcess) -> None:
    r = _post(
        serve, "/v1/completions", json={"model": "smollm2", "prompt": "hi", "max_tokens": 5000}
    )
    error = _error(r, 400)
    assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded"


def test_prompt_too_long_is_400(serve: ServeProcess) -> None:
    r = _post(serve, "/v1/completions", json={"model": "smollm2", "prompt": "hello " * 3000})
    error = _error(r, 400)
    assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"


def test_token_ids_outside_the_vocabulary_are_400_from_the_worker(serve: ServeProcess) -> None:
    r = _post(serve, "/v1/completions", json={"model": "smollm2", "prompt": [1, 2, 10**7]})
    assert _error(r, 400)["param"] == "prompt"


@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_missing_or_wrong_api_key_is_401(serve: ServeProcess, key: str | None) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = _post(serve, "/v1/completions", json={"prompt": "hi"}, headers=headers)
    assert _error(r, 401)["code"] == "invalid_api_key"
    # Probes stay open without a key.
    assert httpx.get(f"{serve.url}/health", timeout=10).status_code == 200


def test_openai_client_raises_its_typed_errors(serve: ServeProcess) -> None:
    client = openai.OpenAI(base_url=f"{serve.url}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="smollm2", prompt="hi", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    bad = openai.OpenAI(base_url=f"{serve.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_bad_requests_kill_and_leak_nothing(serve: ServeProcess) -> None:
    for _ in range(3):
        _post(serve, "/v1/completions", json={"model": "smollm2", "prompt": "x", "top_p": 9})
        _post(serve, "/v1/completions", json={"model": "smollm2", "prompt": [10**7]})
    assert httpx.get(f"{serve.url}/ready", timeout=10).status_code == 200

    def clean() -> bool:
        stats = [group_stats(serve, g["name"]) for g in serve.info["groups"]]
        return all(s.kv_blocks_used == 0 and not s.running and not s.waiting for s in stats)

    wait_for(clean, 20, "no request and no KV block left on any group")
    r = _post(serve, "/v1/completions", json={"model": "smollm2", "prompt": "ok", "max_tokens": 2})
    assert r.status_code == 200
