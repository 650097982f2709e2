"""The openai-http proxy applies the router's checks before forwarding: bad JSON, deep nesting
and lone surrogates are 400 (nesting used to be a 500 RecursionError), every size cap of the
completions and chat bodies is a 400 naming the field, and the body cap is 413; a body at the
caps is forwarded unchanged but for `model`."""

from __future__ import annotations

import asyncio

import pytest

from gearshift.operator.router.server import load_tokenizer
from gearshift.worker.tokenizer import Tokenizer
from tests.router.limit_cases import LIMITS, http_cases
from tests.router.test_openai_backend import Setup, running

ROUTES = ("/v1/completions", "/v1/chat/completions")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer("smollm2")


def _run(tok: Tokenizer, scenario: object) -> None:
    async def main() -> None:
        async with running(tok, 1) as setup:
            await scenario(setup)  # type: ignore[operator]

    asyncio.run(asyncio.wait_for(main(), 180))


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": ' + b"[" * 65 + b"]" * 65 + b"}",
        b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"prompt": "a\\ud800b", "max_tokens": 2}',
        b'{"messages": [{"role": "user", "content": "\\ud83d"}]}',
        b'{"\\udfff": 1}',
        b'{"prompt": "hi",',
        b"[1]",
    ],
    ids=["deep", "recursion", "surrogate", "surrogate-chat", "surrogate-key", "truncated", "array"],
)
def test_bad_json_is_400_and_never_forwarded(tok: Tokenizer, raw: bytes) -> None:
    async def scenario(s: Setup) -> None:
        for route in ROUTES:
            r = await s.http.post(route, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400, (route, r.text)
        assert s.backends[0].requests == []

    _run(tok, scenario)


@pytest.mark.slow
def test_every_body_cap_is_400_and_a_body_at_the_caps_is_forwarded(tok: Tokenizer) -> None:
    cases = [c for c in http_cases() if c.route in ROUTES]

    async def scenario(s: Setup) -> None:
        wrong = []
        for case in cases:
            limit = int(getattr(LIMITS, case.cap.limit))
            sent = len(s.backends[0].requests)
            over = await s.http.post(case.route, json=case.over)
            error = over.json().get("error") or {}
            if over.status_code != 400 or error.get("code") != "limit_exceeded":
                wrong.append(f"{case.id} over: {over.status_code} {over.text[:200]}")
            elif f"at most {limit} " not in error["message"]:
                wrong.append(f"{case.id} over: {error['message']}")
            if len(s.backends[0].requests) != sent:
                wrong.append(f"{case.id} over: forwarded")
            at = await s.http.post(case.route, json=case.at)
            if at.status_code != 200:
                wrong.append(f"{case.id} at the cap: {at.status_code} {at.text[:200]}")
            elif s.backends[0].requests[-1] != {**case.at, "model": "backend-model"}:
                wrong.append(f"{case.id} at the cap: forwarded changed")
        assert not wrong, "\n".join(wrong)

    _run(tok, scenario)


def test_a_body_over_the_cap_is_413(tok: Tokenizer) -> None:
    async def scenario(s: Setup) -> None:
        raw = b'{"prompt": "' + b"a" * LIMITS.max_body_bytes + b'"}'
        r = await s.http.post("/v1/completions", content=raw)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert s.backends[0].requests == []

    _run(tok, scenario)
