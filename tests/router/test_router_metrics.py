"""Router metrics from real traffic against scripted workers: finish reasons, every refusal."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gearshift.operator.router.server import load_tokenizer
from gearshift.v1 import common_pb2, router_pb2, router_pb2_grpc
from gearshift.worker.tokenizer import Tokenizer
from tests.router.fake_worker import Script
from tests.router.test_router_routing import Setup, run

AUTH = {"Authorization": "Bearer k"}
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer("smollm2")


async def _scrape(s: Setup) -> Samples:
    text = (await s.http.get("/metrics")).text
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            out[(sample.name, labels)] = sample.value
    return out


def _success(m: Samples, reason: str) -> float:
    return m.get(("gearshift_request_success_total", (("finished_reason", reason),)), 0.0)


def _rejected(m: Samples) -> dict[tuple[str, str], float]:
    return {
        (dict(labels)["status"], dict(labels)["reason"]): v
        for (name, labels), v in m.items()
        if name == "gearshift_requests_rejected_total"
    }


def test_finish_reasons_count_only_what_traffic_produced(tokenizer: Tokenizer) -> None:
    async def scenario(s: Setup) -> None:
        before = await _scrape(s)
        # No label is created ahead of traffic: a reason appears when a request ends with it.
        assert all(_success(before, r) == 0 for r in ("stop", "length", "abort", "error"))
        assert not [k for k in before if k[0] == "gearshift_request_success_total"]

        for w in s.workers:
            w.script = Script(tokens=[42, 43], finish=common_pb2.FINISH_REASON_STOP)
        assert (await s.http.post("/v1/completions", json={"prompt": "x"}, headers=AUTH)).is_success
        m = await _scrape(s)
        assert (_success(m, "stop"), _success(m, "length")) == (1, 0)

        for w in s.workers:
            w.script = Script(tokens=[42, 43, 44])
        assert (await s.http.post("/v1/completions", json={"prompt": "x"}, headers=AUTH)).is_success
        m = await _scrape(s)
        assert (_success(m, "stop"), _success(m, "length")) == (1, 1)
        assert m[("gearshift_generation_tokens_total", ())] == 5
        assert m[("gearshift_request_generation_tokens_count", ())] == 2

        # abort: the client leaves after the first streamed token.
        for w in s.workers:
            w.script = Script(tokens=list(range(100, 140)), delay_s=0.05)
        body = {"prompt": "x", "stream": True}
        async with s.http.stream("POST", "/v1/completions", json=body, headers=AUTH) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break
        for _ in range(100):
            if _success(await _scrape(s), "abort") == 1:
                break
            await asyncio.sleep(0.05)
        assert _success(await _scrape(s), "abort") == 1

        # error: the group fails after two tokens of a stream.
        for w in s.workers:
            w.script = Script(tokens=[42, 43, 44, 45], fail_after=2)
        r = await s.http.post("/v1/completions", json=body, headers=AUTH)
        assert '"error"' in r.text
        m = await _scrape(s)
        assert [_success(m, r) for r in ("stop", "length", "abort", "error")] == [1, 1, 1, 1]
        assert m[("gearshift_inter_token_latency_seconds_count", ())] >= 1
        assert m[("gearshift_time_to_first_token_seconds_count", ())] == 4
        assert m[("gearshift_e2e_request_latency_seconds_count", ())] == 4
        # Requests of more than one token have a time per output token (the abort may have one).
        assert m[("gearshift_request_time_per_output_token_seconds_count", ())] >= 3
        assert m[("gearshift_request_prompt_tokens_count", ())] == 4
        assert m[("gearshift_prompt_tokens_total", ())] == 4 * len(tokenizer.encode("x"))
        # A mid-stream failure answered 200 and then an error event: not a refusal.
        assert _rejected(m) == {}

    run(tokenizer, scenario, api_keys=("k",))


def test_every_4xx_and_5xx_is_counted_with_its_reason(tokenizer: Tokenizer) -> None:
    async def scenario(s: Setup) -> None:
        post = s.http.post
        assert (await post("/v1/completions", json={"prompt": "x"})).status_code == 401
        bad_json = await post(
            "/v1/completions", content=b"{", headers={**AUTH, "Content-Type": "application/json"}
        )
        assert bad_json.status_code == 400
        body = {"prompt": "x", "model": "nope"}
        assert (await post("/v1/completions", json=body, headers=AUTH)).status_code == 404
        assert (await s.http.get("/v1/nothing-here", headers=AUTH)).status_code == 404
        for w in s.workers:
            w.script = Script(invalid_param="repetition_penalty")
        assert (
            await post("/v1/completions", json={"prompt": "x"}, headers=AUTH)
        ).status_code == 400
        for w in s.workers:
            w.script = Script(tokens=[42, 43, 44], fail_after=1)
        assert (
            await post("/v1/completions", json={"prompt": "x"}, headers=AUTH)
        ).status_code == 502
        # Both groups full: 429.
        for w in s.workers:
            w.script = Script(tokens=list(range(100, 130)), delay_s=0.05)
        held = [
            asyncio.create_task(post("/v1/completions", json={"prompt": "x"}, headers=AUTH))
            for _ in range(2)
        ]
        for _ in range(200):  # both held requests in flight, bounded
            if s.server.router is not None and s.server.router.pool.in_flight == 2:
                break
            await asyncio.sleep(0.02)
        assert (
            await post("/v1/completions", json={"prompt": "x"}, headers=AUTH)
        ).status_code == 429
        await asyncio.gather(*held)
        # Every group fails before the first token: one retry on the other group, then 503.
        for w in s.workers:
            w.script = Script(fail_before_first=grpc.StatusCode.UNAVAILABLE)
        assert (
            await post("/v1/completions", json={"prompt": "x"}, headers=AUTH)
        ).status_code == 503
        # gRPC Generate: a wrong key and a request with neither prompt nor ids.
        assert s.server.ports is not None
        async with grpc.aio.insecure_channel(f"127.0.0.1:{s.server.ports.grpc}") as channel:
            stub = router_pb2_grpc.GenerationStub(channel)
            for metadata, code in (
                ((("authorization", "Bearer wrong"),), grpc.StatusCode.UNAUTHENTICATED),
                ((("authorization", "Bearer k"),), grpc.StatusCode.INVALID_ARGUMENT),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in stub.Generate(router_pb2.GenerateRequest(), metadata=metadata):
                        pass
                assert info.value.code() == code
        # Probes and /metrics are not requests the API refused.
        await s.http.get("/ready")
        m = await _scrape(s)
        assert _rejected(m) == {
            ("401", "invalid_api_key"): 2,  # HTTP and gRPC
            ("400", "invalid_request_error"): 3,  # malformed JSON, worker's field, gRPC
            ("404", "model_not_found"): 1,
            ("404", "not_found"): 1,
            ("502", "worker_failed"): 1,
            ("429", "rate_limit_exceeded"): 1,
            ("503", "service_unavailable"): 1,
        }
        assert m[("gearshift_request_retries_total", ())] == 1

    run(tokenizer, scenario, api_keys=("k",), max_requests_per_group=1)
