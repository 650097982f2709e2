"""Every cap of operator/router/limits.py over real HTTP and gRPC against a router with scripted
workers: one over the cap is a 400 (INVALID_ARGUMENT) naming the field and the limit, exactly
at the cap is not refused for its size; the body cap (413, Content-Length and chunked) and the
JSON nesting and surrogate checks on every route."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from gearshift.operator.router.lanes import LaneConfig
from gearshift.operator.router.limits import (
    DETOKENIZE_CAPS,
    GRPC_CAPS,
    HTTP_CAPS,
    RequestLimits,
    table_rows,
)
from gearshift.operator.router.server import load_tokenizer
from gearshift.v1 import router_pb2, router_pb2_grpc
from gearshift.worker.tokenizer import Tokenizer
from tests.router.fake_worker import Script
from tests.router.limit_cases import LIMITS, grpc_cases, http_cases
from tests.router.test_router_routing import Setup, run

ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
# Threads only, where the test is about the caps (the process lane is the same code; it has
# tests of its own: the 413 test below, test_router_lanes.py), to spare a process start.
THREADS = LaneConfig(processes=0)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer("smollm2")


def test_docs_serving_lists_every_cap() -> None:
    docs = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    missing = [f"| {f} | {t} |" for f, t in table_rows() if f"| {f} | {t} |" not in docs]
    assert not missing, "docs/serving.md's Limits tables lack:\n" + "\n".join(missing)
    lim = RequestLimits()
    for number in (lim.max_body_bytes, lim.max_json_depth, lim.max_sampling_token_ids):
        assert f"{number:,}" in docs or str(number) in docs, number


def test_every_cap_has_a_case() -> None:
    http = {(c.cap.path, c.cap.measure) for c in http_cases()}
    assert http == {(c.path, c.measure) for c in (*HTTP_CAPS, *DETOKENIZE_CAPS)}
    assert {(c.cap.path, c.cap.measure) for c in grpc_cases()} == {
        (c.path, c.measure) for c in GRPC_CAPS
    }


def _refused_for(error: dict[str, Any], path: str, limit: int) -> bool:
    return (
        error.get("code") == "limit_exceeded"
        and error.get("param") == path.split(".")[0]
        and path in error["message"]
        and f"at most {limit} " in error["message"]
    )


@pytest.mark.slow
def test_one_over_each_http_cap_is_400_naming_the_field_and_at_the_cap_is_not(
    tokenizer: Tokenizer,
) -> None:
    async def scenario(s: Setup) -> None:
        for w in s.workers:
            w.script = Script(tokens=[42])
        wrong = []
        for case in http_cases():
            limit = int(getattr(LIMITS, case.cap.limit))
            over = await s.http.post(case.route, json=case.over)
            if over.status_code != 400 or not _refused_for(
                over.json()["error"], case.cap.path, limit
            ):
                wrong.append(f"{case.id} over: {over.status_code} {over.text[:300]}")
            at = await s.http.post(case.route, json=case.at)
            if at.status_code >= 500 or (
                at.status_code == 400 and at.json()["error"]["code"] == "limit_exceeded"
            ):
                wrong.append(f"{case.id} at the cap: {at.status_code} {at.text[:300]}")
        assert not wrong, "\n".join(wrong)

    run(tokenizer, scenario, max_requests_per_group=64, lanes=THREADS)


@pytest.mark.slow
def test_one_over_each_grpc_cap_is_invalid_argument_naming_the_field(
    tokenizer: Tokenizer,
) -> None:
    async def scenario(s: Setup) -> None:
        for w in s.workers:
            w.script = Script(tokens=[42])
        assert s.server.ports is not None
        wrong = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{s.server.ports.grpc}") as channel:
            stub = router_pb2_grpc.GenerationStub(channel)
            for case in grpc_cases():
                limit = int(getattr(LIMITS, case.cap.limit))
                try:
                    async for _ in stub.Generate(case.over, timeout=30):
                        pass
                    wrong.append(f"{case.id}: accepted")
                except grpc.aio.AioRpcError as exc:
                    ok = exc.code() == grpc.StatusCode.INVALID_ARGUMENT
                    details = exc.details() or ""
                    if not (ok and case.cap.path in details and f"at most {limit} " in details):
                        wrong.append(f"{case.id}: {exc.code()} {details[:200]}")
                try:
                    async for _ in stub.Generate(case.at, timeout=30):
                        pass
                except grpc.aio.AioRpcError as exc:
                    if "at most" in (exc.details() or "") or exc.code() in (
                        grpc.StatusCode.INTERNAL,
                        grpc.StatusCode.UNKNOWN,
                    ):
                        wrong.append(f"{case.id} at the cap: {exc.code()} {exc.details()}")
        assert not wrong, "\n".join(wrong)

    run(tokenizer, scenario, max_requests_per_group=64, lanes=THREADS)


SMALL = dataclasses.replace(RequestLimits(), max_body_bytes=64 << 10)


async def _chunked(data: bytes) -> AsyncIterator[bytes]:
    step = 8 << 10
    for i in range(0, len(data), step):
        yield data[i : i + step]


@pytest.mark.slow
def test_bodies_over_the_cap_are_413_with_or_without_content_length(
    tokenizer: Tokenizer,
) -> None:
    async def scenario(s: Setup) -> None:
        for w in s.workers:
            w.script = Script(tokens=[42])
        headers = {"content-type": "application/json"}
        limit = SMALL.max_body_bytes
        fill = limit - len(b'{"prompt": "", "max_tokens": 1}')
        at = b'{"prompt": "' + b"a b " * (fill // 4) + b'", "max_tokens": 1}'
        assert len(at) <= limit
        for route in ROUTES:
            over = at[:-1] + b" " * (limit - len(at) + 1) + b"}"
            assert len(over) == limit + 1
            r = await s.http.post(route, content=over, headers=headers)
            assert r.status_code == 413, (route, r.text)
            error = r.json()["error"]
            assert error["code"] == "request_too_large" and str(limit) in error["message"]
            r = await s.http.post(route, content=_chunked(over), headers=headers)
            assert r.status_code == 413, (route, "chunked", r.text)
        # Far over (more than socket buffers hold): the client still reads the 413.
        far = b'{"prompt": "' + b"a" * (4 << 20) + b'"}'
        for content in (far, _chunked(far)):
            r = await s.http.post("/v1/completions", content=content, headers=headers)
            assert r.status_code == 413, r.text
        r = await s.http.post("/v1/completions", content=at, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = await s.http.post("/v1/completions", content=_chunked(at), headers=headers)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        # The gRPC message cap is the same number.
        assert s.server.ports is not None
        async with grpc.aio.insecure_channel(f"127.0.0.1:{s.server.ports.grpc}") as channel:
            stub = router_pb2_grpc.GenerationStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.Generate(router_pb2.GenerateRequest(prompt="a" * limit)):
                    pass
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (await s.http.get("/health")).status_code == 200

    run(tokenizer, scenario, limits=SMALL)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": ' + b"[" * 65 + b"]" * 65 + b"}",  # past the nesting cap
        b"[" * 100_000 + b"]" * 100_000,  # past the JSON parser's own recursion limit
        b'{"model": "x", "prompt": "a\\ud800b"}',
        b'{"\\udfff": 1, "prompt": "hi"}',  # in a key
        b'{"prompt": "hi", "messages": [{"content": "\\ud83d"}], "tokens": ["\\ud800"]}',
        b'{"prompt": "hi",',
        b"\xff\xfe{}",
        b"[1, 2]",
        b"",
    ],
    ids=[
        "deep",
        "recursion",
        "surrogate",
        "surrogate-key",
        "surrogates",
        "truncated",
        "utf",
        "array",
        "empty",
    ],
)
def test_bad_json_is_400_on_every_route(tokenizer: Tokenizer, raw: bytes) -> None:
    async def scenario(s: Setup) -> None:
        headers = {"content-type": "application/json"}
        for route in ROUTES:
            r = await s.http.post(route, content=raw, headers=headers)
            assert r.status_code == 400, (route, r.text)
            assert r.json()["error"]["message"], route
        assert s.server.ports is not None
        assert (await s.http.get("/health")).status_code == 200

    run(tokenizer, scenario, lanes=THREADS)


@pytest.mark.slow
def test_prompt_token_ids_and_tool_size_caps_are_400_naming_the_field(
    tokenizer: Tokenizer,
) -> None:
    big_tool = {"type": "function", "function": {"name": "f", "description": "d" * (64 << 10)}}
    cases = [
        ("/v1/completions", {"prompt": [1] * (LIMITS.max_token_ids + 1)}, "prompt"),
        ("/v1/completions", {"prompt": [[1], [1] * (LIMITS.max_token_ids + 1)]}, "prompt[1]"),
        # Sequences × sampling token ids: 128 × 513 > 65,536 (each list alone is far below).
        (
            "/v1/completions",
            {"prompt": "hi", "n": 128, "allowed_token_ids": list(range(1, 514))},
            "n:",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "tools": [big_tool]},
            "tools[0]",
        ),
    ]

    async def scenario(s: Setup) -> None:
        for route, body, where in cases:
            r = await s.http.post(route, json=body)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["code"] == "limit_exceeded" and error["message"].startswith(where)
            assert error["param"] == where.split("[")[0].rstrip(":")

    run(tokenizer, scenario, lanes=THREADS)


@pytest.mark.slow
def test_tokenize_and_detokenize_apply_the_caps(tokenizer: Tokenizer) -> None:
    async def scenario(s: Setup) -> None:
        many = [{"role": "user", "content": "a"}] * (LIMITS.max_messages + 1)
        r = await s.http.post("/tokenize", json={"messages": many})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = await s.http.post("/detokenize", json={"tokens": [1] * (LIMITS.max_token_ids + 1)})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
        r = await s.http.post("/tokenize", json={"prompt": "hello world"})
        assert r.status_code == 200 and r.json()["tokens"] == tokenizer.encode("hello world")
        r = await s.http.post("/detokenize", json={"tokens": tokenizer.encode("hello world")})
        assert r.status_code == 200 and r.json()["prompt"] == "hello world"

    run(tokenizer, scenario, lanes=THREADS)


def test_more_unknown_fields_than_the_cap_are_400(tokenizer: Tokenizer) -> None:
    async def scenario(s: Setup) -> None:
        for w in s.workers:
            w.script = Script(tokens=[42])
        extra = {f"x{i}": 1 for i in range(LIMITS.max_unknown_fields + 1)}
        r = await s.http.post("/v1/completions", json={"prompt": "hi", **extra})
        assert r.status_code == 400 and "unknown fields" in r.json()["error"]["message"]
        extra.popitem()
        r = await s.http.post("/v1/completions", json={"prompt": "hi", **extra})
        assert r.status_code == 200, r.text

    run(tokenizer, scenario)
