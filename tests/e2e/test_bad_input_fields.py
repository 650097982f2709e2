"""Issue 11's bad inputs: each gets a 4xx naming the field (HTTP) or INVALID_ARGUMENT /
ALREADY_EXISTS (gRPC), never a 500, and the router checks them before any worker sees them."""

from __future__ import annotations

from typing import Any

import grpc
import httpx
import pytest

from gearshift.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.e2e.conftest import API_KEY
from tests.e2e.serve_process import ServeProcess

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
CHAT = [{"role": "user", "content": "hi"}]


def _post(serve: ServeProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{serve.url}{path}", json=body, headers=HEADERS, timeout=60)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": [1, 2**32]}, "prompt"),  # beyond the proto's uint32
        ({"prompt": [1, -5]}, "prompt"),
        ({"prompt": [1, 49152]}, "prompt"),  # beyond SmolLM2's vocabulary
        ({"prompt": "hi", "stop": [""]}, "stop"),
        ({"prompt": "hi", "stop": ""}, "stop"),
        ({"prompt": "hi", "min_tokens": 2**32}, "min_tokens"),
        ({"prompt": "hi", "min_tokens": 4000, "max_tokens": None}, "min_tokens"),  # > context
        ({"prompt": "hi", "top_k": 2**31}, "top_k"),
        ({"prompt": "hi", "top_k": 49153}, "top_k"),  # above the vocabulary
        ({"prompt": "hi", "top_k": -2}, "top_k"),
        ({"prompt": "hi", "stop_token_ids": [2**32]}, "stop_token_ids"),
        ({"prompt": "hi", "stop_token_ids": [10**6]}, "stop_token_ids"),
        ({"prompt": "hi", "max_tokens": 2**40}, "max_tokens"),
        ({"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"999999": 1}}, "logit_bias"),
        ({"prompt": "hi", "allowed_token_ids": [10**6]}, "allowed_token_ids"),
        ({"prompt": "hi", "n": 0}, "n"),
        ({"prompt": "hi", "n": 3, "best_of": 2}, "best_of"),
        ({"prompt": "hi", "n": 1, "best_of": 2, "stream": True}, "best_of"),
        ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "hi", "suffix": "x"}, "suffix"),
        ({"prompt": ["a"] * 65, "n": 2}, "prompt"),  # more than 128 sequences
        ({"prompt": ["a", ""]}, "prompt"),
        ({"prompt": "hi", "guided_regex": "[a-"}, "guided_regex"),
        ({"prompt": "hi", "guided_json": "{nope"}, "guided_json"),
        ({"prompt": "hi", "guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"prompt": "hi", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
        ({"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}}, None),
        ({"prompt": "hi", "response_format": {"type": "json_schema"}}, "response_format"),
        ({"prompt": "hi", "temperature": 1e39}, "temperature"),
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "hi", "use_beam_search": True}, "use_beam_search"),  # vLLM's, not ours
        ({"prompt": "hi", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
    ],
)
def test_completion_bad_fields_are_400_naming_the_field(
    serve: ServeProcess, body: dict[str, Any], param: str | None
) -> None:
    r = _post(serve, "/v1/completions", {"model": "smollm2", "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    got = r.json()["error"]["param"]
    assert got is not None and (param is None or got.split(".")[0] == param), r.text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
        ({"tool_choice": "required"}, "tool_choice"),  # without tools
        ({"tools": [{"type": "function", "function": {}}]}, "tools"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),  # whole responses only
    ],
)
def test_chat_bad_fields_are_400_naming_the_field(
    serve: ServeProcess, body: dict[str, Any], param: str
) -> None:
    r = _post(serve, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}'),
        ("/v1/completions", b'{"prompt": "hi", "model": "\\udfff"}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud83d"}]}'),
        ("/tokenize", b'{"prompt": "\\ud800"}'),
    ],
)
def test_a_lone_surrogate_anywhere_is_400_not_500(
    serve: ServeProcess, path: str, raw: bytes
) -> None:
    headers = {**HEADERS, "content-type": "application/json"}
    with httpx.Client(base_url=serve.url, headers=headers, timeout=60) as client:
        r = client.post(path, content=raw)
        assert r.status_code == 400, r.text
        assert "surrogate" in r.json()["error"]["message"]
        # The same keep-alive connection still works (a 500 used to reset it).
        ok = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert ok.status_code == 200
        assert client.get("/health").status_code == 200


def test_openapi_schema_documents_400_not_422(serve: ServeProcess) -> None:
    spec = httpx.get(f"{serve.url}/openapi.json", timeout=10).json()
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        responses = spec["paths"][path]["post"]["responses"]
        assert "400" in responses and "422" not in responses, (path, sorted(responses))


def _grpc_generate(serve: ServeProcess, request: router_pb2.GenerateRequest) -> grpc.RpcError:
    with grpc.insecure_channel(serve.grpc_address) as channel:
        stub = router_pb2_grpc.GenerationStub(channel)
        metadata = (("authorization", f"Bearer {API_KEY}"),)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, metadata=metadata, timeout=60))
    return info.value


@pytest.mark.parametrize(
    "sampling",
    [
        common_pb2.SamplingParams(stop=[""]),
        common_pb2.SamplingParams(top_k=10**6),
        common_pb2.SamplingParams(stop_token_ids=[10**6]),
        common_pb2.SamplingParams(min_tokens=10**6),
        common_pb2.SamplingParams(logprobs=99),
        common_pb2.SamplingParams(structured=common_pb2.StructuredOutput(regex="[a-")),
    ],
)
def test_grpc_bad_sampling_is_invalid_argument(
    serve: ServeProcess, sampling: common_pb2.SamplingParams
) -> None:
    err = _grpc_generate(serve, router_pb2.GenerateRequest(prompt="hi", sampling=sampling))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()


def test_grpc_duplicate_request_id_is_already_exists_without_retry(serve: ServeProcess) -> None:
    long = common_pb2.SamplingParams(max_tokens=200, ignore_eos=True)
    with grpc.insecure_channel(serve.grpc_address) as channel:
        stub = router_pb2_grpc.GenerationStub(channel)
        metadata = (("authorization", f"Bearer {API_KEY}"),)
        first = stub.Generate(
            router_pb2.GenerateRequest(prompt="hi", sampling=long, stream=True, request_id="dup"),
            metadata=metadata,
            timeout=120,
        )
        next(first)  # running now
        err = _grpc_generate(
            serve, router_pb2.GenerateRequest(prompt="hi", sampling=long, request_id="dup")
        )
        first.cancel()
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS, err.details()
