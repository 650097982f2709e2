"""cache_salt on the router (operator/router/cache_salt.py): what reaches the worker's wire, with
and without salting by API key; the key itself never leaves the router."""

from __future__ import annotations

import pytest

from gearshift.operator.router import cache_salt, errors
from gearshift.operator.router.protocol import MAX_CACHE_SALT_LENGTH
from gearshift.operator.router.server import load_tokenizer
from gearshift.worker.sampling.params import MAX_CACHE_SALT_LENGTH as WORKER_MAX
from gearshift.worker.sampling.params import InvalidSamplingParams, SamplingParams
from gearshift.worker.tokenizer import Tokenizer
from tests.router.test_router_routing import Setup, run


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer("smollm2")


def test_salts_combine_under_the_key_and_the_key_stays_on_the_router() -> None:
    k = cache_salt.key_salt("sk-secret-key")
    assert "sk-secret-key" not in k and len(k) == 64 and k != cache_salt.key_salt("other")
    assert cache_salt.combine(None, None) == ""
    assert cache_salt.combine("c", None) == "c"
    assert cache_salt.combine(None, k) == k
    assert cache_salt.combine("c", k) == f"{k}:c"
    # A client cannot pick a salt that lands in another key's cache: its salt comes after.
    assert cache_salt.combine(k, cache_salt.key_salt("other")) != k
    for bad in ("", 3, "x" * (MAX_CACHE_SALT_LENGTH + 1)):
        with pytest.raises(errors.APIError) as info:
            cache_salt.check(bad)
        assert info.value.status == 400 and info.value.param == "cache_salt"
    assert MAX_CACHE_SALT_LENGTH == WORKER_MAX  # the router refuses what the worker would
    with pytest.raises(InvalidSamplingParams, match="cache_salt"):
        SamplingParams(cache_salt="x" * (WORKER_MAX + 1))


def test_the_clients_salt_reaches_the_worker(tok: Tokenizer) -> None:
    async def scenario(s: Setup) -> None:
        r = await s.http.post("/v1/completions", json={"prompt": "hi", "cache_salt": "mine"})
        assert r.status_code == 200, r.text
        r = await s.http.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 200, r.text
        wire = [req.sampling.cache_salt for w in s.workers for req in w.requests]
        assert sorted(wire) == ["", "mine"]

    run(tok, scenario, groups=1)


def test_salting_by_key_prefixes_every_request_with_its_keys_salt(tok: Tokenizer) -> None:
    async def scenario(s: Setup) -> None:
        for key, salt in (("k1", None), ("k2", None), ("k1", "mine")):
            body: dict[str, object] = {"prompt": "hi"}
            if salt:
                body["cache_salt"] = salt
            headers = {"Authorization": f"Bearer {key}"}
            r = await s.http.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 200, r.text
        wire = [req.sampling.cache_salt for w in s.workers for req in w.requests]
        k1, k2 = cache_salt.key_salt("k1"), cache_salt.key_salt("k2")
        assert wire == [k1, k2, f"{k1}:mine"]
        assert not {"k1", "k2"} & set(wire)  # the keys themselves never reach a worker

    run(tok, scenario, groups=1, api_keys=("k1", "k2"), cache_salt_by_api_key=True)
