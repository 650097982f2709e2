"""The worker gRPC service over a real (tiny, random) engine on its own thread."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from gearshift.v1 import common_pb2, policy_pb2, worker_pb2, worker_pb2_grpc
from gearshift.worker.config import EngineConfig
from gearshift.worker.launch import start_engine
from gearshift.worker.server.handle import ThreadEngine
from gearshift.worker.server.service import PARAM_METADATA_KEY, WorkerInfo, WorkerService
from tests.worker.helpers import make_hf_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("tiny"), "llama2-bias", vocab=128)


@dataclass
class Worker:
    stub: worker_pb2_grpc.WorkerStub
    engine: ThreadEngine
    address: str = ""  # for clients on another loop (tests/fuzz)

    async def stats(self) -> worker_pb2.WorkerStats:
        return await self.stub.GetStats(worker_pb2.GetStatsRequest(), timeout=5)


@contextlib.asynccontextmanager
async def serving(model: Path, max_requests: int = 16) -> AsyncIterator[Worker]:
    config = EngineConfig(
        model=str(model),
        dtype="float32",
        skip_tokenizer_init=True,
        detokenize=False,
        kv_cache_bytes=4 << 20,
        max_num_seqs=4,
    )
    engine = start_engine(config, {"shift": {"sp": 1, "tp": 1}})
    handle = ThreadEngine(engine, idle_wait=0.05)
    service = WorkerService()
    service.attach(handle, WorkerInfo("tiny", engine.max_model_len, 1, "rev-1", max_requests))
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Worker(worker_pb2_grpc.WorkerStub(channel), handle, f"127.0.0.1:{port}")
    finally:
        await channel.close()
        await server.stop(grace=None)
        await asyncio.to_thread(handle.loop.stop)
        assert not engine.has_unfinished_requests(), "requests left in the engine"
        assert engine.blocks.leaked_blocks() == [] and engine.blocks.num_free_blocks == (
            engine.blocks.num_blocks
        )
        engine.shutdown()


def run(model: Path, scenario: Callable[[Worker], Awaitable[None]], **kw: int) -> None:
    async def main() -> None:
        async with serving(model, **kw) as worker:
            await scenario(worker)

    asyncio.run(asyncio.wait_for(main(), 60))


def _request(rid: str, max_tokens: int = 5, **sampling: object) -> worker_pb2.WorkerGenerateRequest:
    params: dict[str, object] = {"temperature": 0.0, "ignore_eos": True, **sampling}
    return worker_pb2.WorkerGenerateRequest(
        request_id=rid,
        prompt_token_ids=[1, 2, 3, 4],
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
    )


async def _wait(predicate: Callable[[], Awaitable[bool]], what: str, timeout: float = 10) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def test_generate_streams_tokens_then_a_final_response_with_usage_and_timing(tiny: Path) -> None:
    async def scenario(w: Worker) -> None:
        out = [r async for r in w.stub.Generate(_request("a", 5, logprobs=1))]
        tokens = [t for r in out for t in r.token_ids]
        assert len(tokens) == 5 and len(out) <= 5
        assert sum(len(r.logprobs) for r in out) == 5
        last = out[-1]
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (4, 5)
        t = out[0].timing
        assert 0 < t.queued_time <= t.scheduled_time <= t.first_token_time
        assert last.timing.finished_time >= t.first_token_time

    run(tiny, scenario)


def test_a_cancelled_call_aborts_the_request_and_frees_its_blocks(tiny: Path) -> None:
    async def scenario(w: Worker) -> None:
        call = w.stub.Generate(_request("long", 100))
        await call.read()
        await call.read()
        assert (await w.stats()).kv_blocks_used > 0
        call.cancel()

        async def freed() -> bool:
            s = await w.stats()
            return s.kv_blocks_used == 0 and s.running == 0

        await _wait(freed, "blocks freed after the cancel")

    run(tiny, scenario)


@pytest.mark.parametrize(
    ("request_", "param"),
    [
        (_request("t", temperature=-1.0), "temperature"),
        (_request("p", top_p=0.0), "top_p"),
        (worker_pb2.WorkerGenerateRequest(request_id="v", prompt_token_ids=[1, 999]), "prompt"),
        (_request("m", 10_000), "max_tokens"),
        # One engine: replica 0 is the only one (a replica group's endpoint takes more).
        (
            worker_pb2.WorkerGenerateRequest(request_id="r", prompt_token_ids=[1], replica=1),
            "replica",
        ),
    ],
)
def test_bad_requests_are_invalid_argument_naming_the_field(
    tiny: Path, request_: worker_pb2.WorkerGenerateRequest, param: str
) -> None:
    async def scenario(w: Worker) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            _ = [r async for r in w.stub.Generate(request_)]
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (PARAM_METADATA_KEY, param) in tuple(info.value.trailing_metadata() or ())

    run(tiny, scenario)


def test_abort_ends_the_stream_with_abort_and_reports_whether_it_was_found(tiny: Path) -> None:
    async def scenario(w: Worker) -> None:
        call = w.stub.Generate(_request("x", 200))
        await call.read()
        assert (await w.stub.Abort(worker_pb2.AbortRequest(request_id="x"))).found
        last = await call.read()
        while last.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
            last = await call.read()
        assert last.finish_reason == common_pb2.FINISH_REASON_ABORT
        assert not (await w.stub.Abort(worker_pb2.AbortRequest(request_id="x"))).found

    run(tiny, scenario)


def test_full_worker_answers_resource_exhausted(tiny: Path) -> None:
    async def scenario(w: Worker) -> None:
        held = w.stub.Generate(_request("held", 200))
        await held.read()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            _ = [r async for r in w.stub.Generate(_request("more"))]
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        held.cancel()

    run(tiny, scenario, max_requests=1)


def test_profile_tetris_is_a_failed_precondition_on_another_policy(tiny: Path) -> None:
    async def scenario(w: Worker) -> None:
        request = worker_pb2.ProfileTetrisRequest(histories=[0, 8], lengths=[4, 8, 12])
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await w.stub.ProfileTetris(request, timeout=10)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "shift policy" in (info.value.details() or "")

    run(tiny, scenario)


def test_apply_policy_changes_the_threshold_live_and_the_gear_follows(tiny: Path) -> None:
    def shift(**kw: int) -> worker_pb2.ApplyPolicyRequest:
        return worker_pb2.ApplyPolicyRequest(
            policy=policy_pb2.Policy(shift=policy_pb2.ShiftPolicy(**kw))
        )

    async def scenario(w: Worker) -> None:
        stats = await w.stats()
        assert stats.revision == "rev-1" and stats.policy.shift.threshold == 256
        r = await w.stub.ApplyPolicy(shift(threshold=0))
        assert r.applied and r.policy.shift.threshold == 0
        _ = [x async for x in w.stub.Generate(_request("b", 3))]
        stats = await w.stats()
        assert stats.gear == "base" and stats.policy.shift.threshold == 0
        base_steps = {g.name: g.steps for g in stats.gears}["base"]
        assert base_steps >= 3
        r = await w.stub.ApplyPolicy(shift(threshold=1000))
        assert r.applied
        _ = [x async for x in w.stub.Generate(_request("s", 3))]
        assert (await w.stats()).gear == "shift"
        # A layout field is not live: refused, nothing changes.
        r = await w.stub.ApplyPolicy(shift(sp=2, threshold=5))
        assert not r.applied and "shift.sp" in r.message and r.policy.shift.threshold == 1000
        r = await w.stub.ApplyPolicy(
            worker_pb2.ApplyPolicyRequest(
                policy=policy_pb2.Policy(static=policy_pb2.StaticPolicy())
            )
        )
        assert not r.applied and "static" in r.message

    run(tiny, scenario)
