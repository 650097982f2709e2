"""`make serve`'s configuration on SmolLM2: its printed layout and start-up log, --api-key-file,
per-group metrics that move with real traffic, and Admin Drain over gRPC."""

from __future__ import annotations

import asyncio
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gearshift.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.e2e.serve_process import ServeProcess, wait_for

REPO = Path(__file__).resolve().parents[2]
KEY = "key-from-a-file"
HEADERS = {"Authorization": f"Bearer {KEY}"}
GROUPS = ("gearshift-g0", "gearshift-g1")
# 8 MiB of bf16 KV is 5 blocks of 64 tokens: three 200-token requests cannot all fit.
KV_BYTES = 8 << 20


def makefile_args(variable: str) -> list[str]:
    found = re.search(rf"^{variable} \?= (.*)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert found, f"{variable} is not in the Makefile"
    return shlex.split(found.group(1))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    tmp = tmp_path_factory.mktemp("make-serve")
    key_file = tmp / "keys.txt"
    key_file.write_text(f"# one key per line\n\n  {KEY}  \n")
    proc = ServeProcess(
        tmp,
        "--model",
        "smollm2",
        *makefile_args("SERVE_ARGS"),
        "--groups",
        "2",
        "--api-key-file",
        str(key_file),
        "--dtype",
        "bfloat16",
        "--max-num-seqs",
        "2",
        "--max-model-len",
        "256",
        "--kv-cache-bytes",
        str(KV_BYTES),
        log_level=None,  # the default level: what a user sees
    )
    with proc:
        try:
            yield proc
        finally:
            assert proc.stop() == 0, proc.tail()
            assert proc.survivors() == []


def _metrics(serve: ServeProcess) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{serve.url}/metrics").text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out.setdefault(s.name, {})[labels] = s.value
    return out


def _group_value(serve: ServeProcess, name: str) -> float:
    """Sum over groups of a per-group metric."""
    return sum(_metrics(serve).get(name, {}).values())


@pytest.mark.slow
def test_make_serve_prints_its_layout_and_logs_start_up_stages(served: ServeProcess) -> None:
    log = served.tail(200_000)
    # Two groups share the 2 cores: one each, a small CPU, so one static rank per group.
    chosen = re.search(r"gearshift serve: layout fastest -> (.*)", log)
    assert chosen, log[-3000:]
    assert chosen.group(1).startswith("static, one rank: ") and "small CPU" in chosen.group(1)
    for stage in (
        "loading smollm2",  # model load
        "KV cache: ",  # its size
        "engine ready in",  # every rank joined
        "worker gearshift-g1 serving on port",
        "router for smollm2: http 127.0.0.1:",  # the ports
    ):
        assert stage in log, f"no {stage!r} in the default-level log:\n{log[-3000:]}"


@pytest.mark.slow
def test_api_key_file_keys_are_required(served: ServeProcess) -> None:
    body = {"model": "smollm2", "prompt": "Hi", "max_tokens": 2}
    assert httpx.post(f"{served.url}/v1/completions", json=body, timeout=60).status_code == 401
    wrong = {"Authorization": "Bearer # one key per line"}
    r = httpx.post(f"{served.url}/v1/completions", json=body, headers=wrong, timeout=60)
    assert r.status_code == 401
    r = httpx.post(f"{served.url}/v1/completions", json=body, headers=HEADERS, timeout=60)
    assert r.status_code == 200, r.text
    rejected = _metrics(served)["gearshift_requests_rejected_total"]
    assert rejected[(("reason", "invalid_api_key"), ("status", "401"))] == 2


async def _long(client: httpx.AsyncClient, tokens: int) -> httpx.Response:
    body = {
        "model": "smollm2",
        "prompt": "Count:",
        "max_tokens": tokens,
        "ignore_eos": True,
        "temperature": 0,
    }
    return await client.post("/v1/completions", json=body, headers=HEADERS)


@pytest.mark.slow
def test_per_group_metrics_move_with_traffic(served: ServeProcess) -> None:
    before = _metrics(served)
    preempted = sum(before.get("gearshift_num_preemptions_total", {}).values())
    queued = sum(before.get("gearshift_request_queue_time_seconds_count", {}).values())
    # The group's gauges come from its last stats poll: a request the previous test finished
    # may still show as running until the next poll (bounded wait, not a timing assertion).
    wait_for(lambda: _group_value(served, "gearshift_num_requests_running") == 0, 30, "idle")
    seen: dict[str, float] = {}
    moving = (
        "gearshift_num_requests_running",
        "gearshift_num_requests_waiting",
        "gearshift_kv_cache_usage_perc",
        "gearshift_outstanding_tokens",
        "gearshift_router_requests_in_flight",
    )

    async def main() -> None:
        async with httpx.AsyncClient(base_url=served.url, timeout=300) as c:
            # Six requests over two groups of max-num-seqs 2: each group runs two and queues one;
            # 200 tokens each outgrow the 5 KV blocks, so the scheduler preempts.
            tasks = [asyncio.create_task(_long(c, 200)) for _ in range(6)]
            while not all(t.done() for t in tasks):
                m = await asyncio.to_thread(_metrics, served)
                for name in moving:
                    seen[name] = max(seen.get(name, 0.0), sum(m.get(name, {}).values()))
                await asyncio.sleep(0.2)
            for t in tasks:
                assert t.result().status_code == 200, t.result().text

    asyncio.run(asyncio.wait_for(main(), 540))
    assert all(seen[name] > 0 for name in moving), seen
    # Gauges come from the workers' stats, polled: wait for the idle report.
    wait_for(lambda: _group_value(served, "gearshift_num_requests_running") == 0, 10, "idle groups")
    after = _metrics(served)
    assert sum(after["gearshift_num_preemptions_total"].values()) > preempted
    assert sum(after["gearshift_request_queue_time_seconds_count"].values()) == queued + 6
    assert after["gearshift_gear"] == {(("gear", "static"), ("group", g)): 1.0 for g in GROUPS}
    assert all(v > 0 for v in after["gearshift_gear_steps_total"].values())
    assert all(v > 0 for v in after["gearshift_gear_tokens_total"].values())
    assert set(after["gearshift_gear_switches_total"].values()) == {0.0}  # one gear: no switch
    assert after["gearshift_group_serving"] == {(("group", g),): 1.0 for g in GROUPS}


def _generate(serve: ServeProcess, tokens: int) -> router_pb2.GenerateResponse:
    with grpc.insecure_channel(serve.grpc_address) as channel:
        responses = router_pb2_grpc.GenerationStub(channel).Generate(
            router_pb2.GenerateRequest(
                prompt="Count:",
                sampling=common_pb2.SamplingParams(max_tokens=tokens, ignore_eos=True),
            ),
            metadata=(("authorization", f"Bearer {KEY}"),),
            timeout=300,
        )
        return next(iter(responses))


def _drain(serve: ServeProcess, group: str, resume: bool = False) -> router_pb2.DrainResponse:
    with grpc.insecure_channel(serve.admin_address) as channel:
        return router_pb2_grpc.AdminStub(channel).Drain(
            router_pb2.DrainRequest(group=group, resume=resume),
            timeout=10,
            metadata=serve.metadata,
        )


@pytest.mark.slow
def test_admin_drain_lets_in_flight_requests_finish_and_routes_new_ones_elsewhere(
    served: ServeProcess,
) -> None:
    async def main() -> None:
        async with httpx.AsyncClient(base_url=served.url, timeout=300) as c:
            held = asyncio.create_task(_long(c, 120))
            await asyncio.to_thread(
                wait_for,
                lambda: _group_value(served, "gearshift_router_requests_in_flight") == 1,
                30,
                "one request in flight",
            )
            m = await asyncio.to_thread(_metrics, served)
            busy = next(
                dict(k)["group"]
                for k, v in m["gearshift_router_requests_in_flight"].items()
                if v == 1
            )
            response = await asyncio.to_thread(_drain, served, busy)
            assert response.in_flight == 1
            # New requests go to the other group while the drained one finishes its request.
            others = [await asyncio.to_thread(_generate, served, 3) for _ in range(3)]
            assert {o.group for o in others} == set(GROUPS) - {busy}
            done = await held
            assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 120
            serving = (await asyncio.to_thread(_metrics, served))["gearshift_group_serving"]
            assert serving[(("group", busy),)] == 0.0
            # While drained, a long request must go to the other group; then resume: the next
            # request goes to the resumed group, the one with nothing outstanding.
            other = asyncio.create_task(asyncio.to_thread(_generate, served, 60))
            await asyncio.to_thread(
                wait_for,
                lambda: _group_value(served, "gearshift_router_requests_in_flight") == 1,
                30,
                "the long request in flight",
            )
            await asyncio.to_thread(_drain, served, busy, True)
            assert (await asyncio.to_thread(_generate, served, 3)).group == busy
            assert (await other).group != busy

    asyncio.run(asyncio.wait_for(main(), 300))
