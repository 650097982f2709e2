"""cache_salt through the router and a real worker (issue 31, item 9): a prompt sent again under
the same salt is served from the prefix cache (cached_tokens > 0), under another salt it is not
(cached_tokens 0: nothing learnt about the other salt's prompts); with --cache-salt-by-api-key
each API key has its own cache, on the HTTP and the gRPC API."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from gearshift.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.e2e.serve_process import ServeProcess

KEY1, KEY2 = "cache-key-one", "cache-key-two"
# Long enough for several full KV blocks (64 tokens each on CPU).
PROMPT = "The quick brown fox jumps over the lazy dog. " * 12  # two full 64-token blocks


@pytest.fixture(scope="module")
def salted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    tmp: Path = tmp_path_factory.mktemp("salted")
    proc = ServeProcess(
        tmp,
        "--model",
        "smollm2",
        "--dtype",
        "float32",  # bfloat16 is emulated on CPUs without avx512_bf16: 5x slower prefill
        "--groups",
        "1",  # one prefix cache: a hit or a miss is the salt's doing, not the routing's
        "--max-num-seqs",
        "2",
        "--max-model-len",
        "1024",
        "--kv-cache-bytes",
        str(64 << 20),
        "--api-key",
        KEY1,
        "--api-key",
        KEY2,
        "--cache-salt-by-api-key",
    )
    with proc:
        yield proc
    assert proc.survivors() == []


def _cached(serve: ServeProcess, key: str, salt: str | None = None) -> int:
    body: dict[str, object] = {"prompt": PROMPT, "max_tokens": 1}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(
        f"{serve.url}/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))


def _grpc_cached(serve: ServeProcess, key: str, salt: str = "") -> int:
    with grpc.insecure_channel(serve.grpc_address) as channel:
        response = next(
            iter(
                router_pb2_grpc.GenerationStub(channel).Generate(
                    router_pb2.GenerateRequest(
                        prompt=PROMPT,
                        sampling=common_pb2.SamplingParams(max_tokens=1, cache_salt=salt),
                    ),
                    metadata=(("authorization", f"Bearer {key}"),),
                    timeout=300,
                )
            )
        )
    return int(response.usage.cached_prompt_tokens)


@pytest.mark.slow
def test_a_prompt_is_cached_within_one_salt_and_invisible_across_salts(
    salted: ServeProcess,
) -> None:
    assert _cached(salted, KEY1, "alpha") == 0  # the first time: computed
    assert _cached(salted, KEY1, "alpha") > 0  # the same salt: served from the cache
    assert _cached(salted, KEY1, "beta") == 0  # another salt of the same key: not shared
    assert _cached(salted, KEY1, "beta") > 0


@pytest.mark.slow
def test_each_api_key_has_its_own_prefix_cache_on_http_and_grpc(salted: ServeProcess) -> None:
    assert _cached(salted, KEY1) == 0
    assert _cached(salted, KEY1) > 0
    assert _cached(salted, KEY2) == 0  # the other key's cache holds nothing of key one's
    assert _grpc_cached(salted, KEY2) > 0  # the same key, through gRPC: shared
    assert _grpc_cached(salted, KEY1) > 0
    assert _grpc_cached(salted, KEY2, "gamma") == 0


@pytest.mark.slow
def test_an_empty_or_oversized_cache_salt_is_refused_naming_it(salted: ServeProcess) -> None:
    for salt in ("", "x" * 1025, 7):
        r = httpx.post(
            f"{salted.url}/v1/completions",
            json={"prompt": "hi", "max_tokens": 1, "cache_salt": salt},
            headers={"Authorization": f"Bearer {KEY1}"},
            timeout=60,
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "cache_salt"
