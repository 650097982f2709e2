"""The router against scripted fake workers: retry, failures, stop strings, 429, auth, admin."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest

from gearshift.operator.router import config as config_mod
from gearshift.operator.router.config import GroupSpec, RouterConfig
from gearshift.operator.router.server import RouterServer, load_tokenizer
from gearshift.v1 import common_pb2, policy_pb2, router_pb2, router_pb2_grpc
from gearshift.worker.tokenizer import Tokenizer
from tests.router.fake_worker import FakeWorker, Script


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer("smollm2")


@dataclass
class Setup:
    workers: list[FakeWorker]
    server: RouterServer
    http: httpx.AsyncClient

    @property
    def admin_address(self) -> str:
        assert self.server.ports is not None
        return f"127.0.0.1:{self.server.ports.admin}"


@contextlib.asynccontextmanager
async def running(tok: Tokenizer, groups: int = 2, **cfg: object) -> AsyncIterator[Setup]:
    workers = [await FakeWorker(f"g{i}").start() for i in range(groups)]
    config = RouterConfig(
        model_name="fake",
        model_path="smollm2",
        groups=tuple(GroupSpec(w.name, w.address) for w in workers),
        host="127.0.0.1",
        http_port=0,
        grpc_port=0,
        admin_host="127.0.0.1",
        admin_port=0,
        poll_interval_s=0.1,
        rpc_timeout_s=1.0,
        drain_timeout_s=2.0,
        insecure_no_auth=True,  # the fake workers take no token; auth: control-plane tests
        **cfg,  # type: ignore[arg-type]
    )
    server = RouterServer(config, tokenizer=tok)
    ports = await server.start()
    http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{ports.http}", timeout=20)
    try:
        yield Setup(workers, server, http)
    finally:
        await http.aclose()
        await server.stop(drain_timeout_s=1)
        for w in workers:
            await w.stop()


def run(tok: Tokenizer, scenario: Callable[[Setup], Awaitable[None]], **cfg: object) -> None:
    async def main() -> None:
        async with running(tok, **cfg) as setup:
            await scenario(setup)

    asyncio.run(asyncio.wait_for(main(), 180))  # a bound, generous for a loaded machine


def _sse(body: str) -> list[dict]:
    lines = [ln[6:] for ln in body.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_text_is_detokenised_and_cut_at_a_stop_string_which_cancels_the_worker(
    tokenizer: Tokenizer,
) -> None:
    ids = tokenizer.encode("Hello world, this is a long answer that goes on", False)

    async def scenario(s: Setup) -> None:
        for w in s.workers:
            w.script = Script(tokens=ids, delay_s=0.01)
        r = await s.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 50})
        assert r.json()["choices"][0]["text"] == tokenizer.decode(ids)
        r = await s.http.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 50, "stop": [", this"]}
        )
        body = r.json()
        assert body["choices"][0]["text"] == "Hello world"
        assert body["choices"][0]["finish_reason"] == "stop"
        assert body["choices"][0]["stop_reason"] == ", this"
        await asyncio.sleep(0.2)
        assert any(w.cancelled for w in s.workers), "the worker call was not cancelled"

    run(tokenizer, scenario)


def test_streaming_sends_one_chunk_per_token_then_usage_then_done(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("one two three", False)

    async def scenario(s: Setup) -> None:
        for w in s.workers:
            w.script = Script(tokens=ids)
        r = await s.http.post(
            "/v1/completions",
            json={"prompt": "x", "stream": True, "stream_options": {"include_usage": True}},
        )
        chunks = _sse(r.text)
        assert len(chunks) == len(ids) + 1
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(ids)
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"

    run(tokenizer, scenario)


def test_a_group_failing_before_the_first_token_is_retried_on_another(
    tokenizer: Tokenizer,
) -> None:
    async def scenario(s: Setup) -> None:
        bad, good = s.workers
        bad.script = Script(fail_before_first=grpc.StatusCode.UNAVAILABLE)
        good.script = Script(tokens=[42, 43])
        for _ in range(4):
            r = await s.http.post("/v1/completions", json={"prompt": "x"})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 2
        assert bad.requests, "the failing group was never tried"

    run(tokenizer, scenario)


def test_a_group_failing_mid_stream_ends_it_with_a_clear_error(tokenizer: Tokenizer) -> None:
    async def scenario(s: Setup) -> None:
        for w in s.workers:
            w.script = Script(tokens=[42, 43, 44, 45], fail_after=2)
        r = await s.http.post("/v1/completions", json={"prompt": "x", "stream": True})
        chunks = _sse(r.text)
        assert len([c for c in chunks if "choices" in c]) == 2
        assert "failed after 2 tokens" in chunks[-1]["error"]["message"]
        r = await s.http.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 502 and r.json()["error"]["code"] == "worker_failed"

    run(tokenizer, scenario)


def test_worker_invalid_argument_is_a_400_naming_the_field(tokenizer: Tokenizer) -> None:
    async def scenario(s: Setup) -> None:
        for w in s.workers:
            w.script = Script(invalid_param="repetition_penalty")
        r = await s.http.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "repetition_penalty"
        assert sum(len(w.requests) for w in s.workers) == 1  # a bad request is not retried

    run(tokenizer, scenario)


def test_full_groups_answer_429_with_retry_after(tokenizer: Tokenizer) -> None:
    async def scenario(s: Setup) -> None:
        for w in s.workers:
            w.script = Script(tokens=list(range(100, 140)), delay_s=0.05)
        held = [
            asyncio.create_task(s.http.post("/v1/completions", json={"prompt": "x"}))
            for _ in range(2)
        ]
        for _ in range(200):  # both held requests in flight, bounded
            if s.server.router is not None and s.server.router.pool.in_flight == 2:
                break
            await asyncio.sleep(0.02)
        r = await s.http.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert all(t.status_code == 200 for t in await asyncio.gather(*held))

    run(tokenizer, scenario, max_requests_per_group=1)


def test_requests_spread_by_least_outstanding_tokens(tokenizer: Tokenizer) -> None:
    async def scenario(s: Setup) -> None:
        for w in s.workers:
            w.script = Script(tokens=list(range(100, 110)), delay_s=0.05)
        # A long request holds many outstanding tokens on one group; short ones go elsewhere.
        long = asyncio.create_task(
            s.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 400})
        )
        for _ in range(500):  # until the long request reached its group (bounded: 10 s)
            if any(w.requests for w in s.workers):
                break
            await asyncio.sleep(0.02)
        busy = next(w for w in s.workers if w.requests)
        other = next(w for w in s.workers if w is not busy)
        await asyncio.gather(
            *(
                s.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 5})
                for _ in range(3)
            )
        )
        assert len(other.requests) == 3 and len(busy.requests) == 1
        await long

    run(tokenizer, scenario)


def test_each_engine_replica_a_group_reports_is_a_routing_target(tokenizer: Tokenizer) -> None:
    async def scenario(s: Setup) -> None:
        replicated, plain = s.workers
        for w in s.workers:
            w.script = Script(tokens=list(range(100, 110)), delay_s=0.05)
        replicated.replica_outstanding = [1000, 0, 0]  # replica 0 is busy with others' work
        plain.outstanding = 5000
        await asyncio.sleep(0.4)  # a few stats polls
        long = asyncio.create_task(
            s.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 400})
        )
        await asyncio.sleep(0.1)
        shorts = [
            s.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 5}) for _ in range(2)
        ]
        assert all(r.status_code == 200 for r in await asyncio.gather(*shorts, long))
        # Each replica is routed on its own load: the long request on an idle replica, the short
        # ones on the other idle one, none on the busy replica or the busier group.
        assert [r.replica for r in replicated.requests] == [1, 2, 2]
        assert not plain.requests
        # A group with one engine gets requests that name no replica.
        replicated.replica_outstanding = [1000, 1000, 1000]
        plain.outstanding = 0
        await asyncio.sleep(0.4)
        r = await s.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 5})
        assert r.status_code == 200
        assert len(plain.requests) == 1 and not plain.requests[0].HasField("replica")

    run(tokenizer, scenario)


def test_api_keys_guard_the_api_but_not_the_probes(tokenizer: Tokenizer) -> None:
    async def scenario(s: Setup) -> None:
        assert (await s.http.get("/v1/models")).status_code == 401
        bad = await s.http.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
        ok = await s.http.get("/v1/models", headers={"Authorization": "Bearer k2"})
        assert ok.status_code == 200
        for path in ("/health", "/ready", "/metrics", "/version"):
            assert (await s.http.get(path)).status_code == 200

    run(tokenizer, scenario, api_keys=("k1", "k2"))


def test_ready_follows_the_groups_and_health_does_not(tokenizer: Tokenizer) -> None:
    async def scenario(s: Setup) -> None:
        assert (await s.http.get("/ready")).status_code == 200
        for w in s.workers:
            await w.stop()
        for _ in range(50):
            if (await s.http.get("/ready")).status_code == 503:
                break
            await asyncio.sleep(0.1)
        assert (await s.http.get("/ready")).status_code == 503
        assert (await s.http.get("/health")).status_code == 200
        r = await s.http.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"

    run(tokenizer, scenario)


def test_admin_applies_policy_reports_status_and_drains(tokenizer: Tokenizer) -> None:
    async def scenario(s: Setup) -> None:
        async with grpc.aio.insecure_channel(s.admin_address) as channel:
            admin = router_pb2_grpc.AdminStub(channel)
            policy = policy_pb2.Policy(shift=policy_pb2.ShiftPolicy(threshold=7))
            r = await admin.ApplyPolicy(router_pb2.AdminApplyPolicyRequest(policy=policy))
            assert r.applied and [x.group for x in r.results] == ["g0", "g1"]
            status = await admin.GetStatus(router_pb2.GetStatusRequest())
            assert [g.policy.shift.threshold for g in status.groups] == [7, 7]
            bad = policy_pb2.Policy(shift=policy_pb2.ShiftPolicy(sp=2))
            r = await admin.ApplyPolicy(router_pb2.AdminApplyPolicyRequest(policy=bad, group="g1"))
            assert not r.applied and "shift.sp" in r.results[0].message
            await admin.Drain(router_pb2.DrainRequest(group="g0"))
            for w in s.workers:
                w.script = Script(tokens=[5])
            for _ in range(3):
                assert (await s.http.post("/v1/completions", json={"prompt": "x"})).is_success
            assert not s.workers[0].requests and len(s.workers[1].requests) == 3
            await admin.Drain(router_pb2.DrainRequest(group="g0", resume=True))
            status = await admin.GetStatus(router_pb2.GetStatusRequest())
            assert all(g.serving and not g.draining for g in status.groups)

    run(tokenizer, scenario)


def test_grpc_generation_returns_the_whole_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Paris is nice", False)

    async def scenario(s: Setup) -> None:
        for w in s.workers:
            w.script = Script(tokens=ids, finish=common_pb2.FINISH_REASON_STOP)
        assert s.server.ports is not None
        async with grpc.aio.insecure_channel(f"127.0.0.1:{s.server.ports.grpc}") as channel:
            stub = router_pb2_grpc.GenerationStub(channel)
            out = [r async for r in stub.Generate(router_pb2.GenerateRequest(prompt="x"))]
        assert len(out) == 1 and out[0].text == "Paris is nice"
        assert out[0].finish_reason == common_pb2.FINISH_REASON_STOP
        assert out[0].usage.completion_tokens == len(ids) and out[0].group in ("g0", "g1")

    run(tokenizer, scenario)


def test_the_router_process_never_imports_torch() -> None:
    code = (
        "import sys\n"
        "import gearshift.operator.router.server, gearshift.operator.commands.serve\n"
        "from gearshift.operator.cli import build_parser; build_parser()\n"
        # What `serve` checks before it starts any worker (it imports these in its body).
        "from gearshift.v1 import policy_pb2\n"
        "from gearshift.worker.config import EngineConfig, check_attention_backend\n"
        "from gearshift.worker.policies.checks import default_world\n"
        "from gearshift.worker.policies.support import check_supported\n"
        "p = policy_pb2.Policy(); p.shift.sp = 2\n"
        "assert default_world(check_supported(p)) == 2\n"
        "EngineConfig(model='m', dtype='bf16'); check_attention_backend('auto', 'cpu')\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_router_json_changes_add_and_retire_groups(tokenizer: Tokenizer, tmp_path: Path) -> None:
    async def main() -> None:
        workers = [await FakeWorker(f"demo-g{i}").start() for i in range(2)]
        path = tmp_path / "router.json"

        def write(ws: list[FakeWorker]) -> None:
            groups = [{"name": w.name, "address": w.address} for w in ws]
            path.write_text(
                json.dumps(
                    {
                        "deployment": "demo",
                        "model": {"name": "fake", "path": "smollm2"},
                        "backend": "worker-grpc",
                        "groups": groups,
                        "ports": {"http": 0, "grpc": 0, "admin": 0},
                        "apiKeyEnv": "",
                    }
                )
            )

        write(workers[:1])
        config = dataclasses.replace(
            config_mod.from_file(path, env={}),
            host="127.0.0.1",
            admin_host="127.0.0.1",
            poll_interval_s=0.1,
            reload_interval_s=0.1,
            insecure_no_auth=True,  # fake workers without tokens
        )
        server = RouterServer(config, tokenizer=tokenizer)
        await server.start()
        assert server.router is not None
        pool = server.router.pool
        try:
            assert list(pool.groups) == ["demo-g0"]
            write(workers)
            for _ in range(100):
                if len(pool.serving()) == 2:
                    break
                await asyncio.sleep(0.05)
            assert [g.name for g in pool.serving()] == ["demo-g0", "demo-g1"]
            write(workers[1:])
            for _ in range(100):
                if list(pool.groups) == ["demo-g1"]:
                    break
                await asyncio.sleep(0.05)
            assert list(pool.groups) == ["demo-g1"]
        finally:
            await server.stop(drain_timeout_s=1)
            for w in workers:
                await w.stop()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_add_special_tokens_is_honoured_with_vllms_defaults(tokenizer: Tokenizer) -> None:
    """Completions add the tokenizer's special tokens unless told not to; chat adds none unless
    told to (its template writes them). SmolLM2 adds none itself, so this tokenizer adds BOS."""
    from tokenizers import processors

    with_bos = copy.deepcopy(tokenizer)
    bos = with_bos.backend.token_to_id("<|endoftext|>")
    with_bos.backend.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)]
    )
    plain = tokenizer.encode("Hello there", False)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])

    async def scenario(s: Setup) -> None:
        bodies: list[tuple[str, dict]] = [
            ("/v1/completions", {"prompt": "Hello there", "max_tokens": 1}),
            ("/v1/completions", {"prompt": "Hello there", "add_special_tokens": False}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
            (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "Hi"}], "add_special_tokens": True},
            ),
        ]
        seen = []
        for path, body in bodies:
            r = await s.http.post(path, json={"model": "fake", "max_tokens": 1, **body})
            assert r.status_code == 200, r.text
            sent = [req for w in s.workers for req in w.requests]
            seen.append(list(sent[-1].prompt_token_ids))
            for w in s.workers:
                w.requests.clear()
        assert seen == [[bos, *plain], plain, chat, [bos, *chat]]

    run(with_bos, scenario)
