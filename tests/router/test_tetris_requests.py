"""The router's Tetris planning (§5.1–5.2): each request sent to a tetris group carries the
planner's chunk plan and decode instance, from the group's reported instances plus the router's
own bookings between polls (Eq. (2) queues, virtual usage)."""

from __future__ import annotations

import asyncio

import pytest

from gearshift.operator.planner.cdsp import PlannerRules, plan_request
from gearshift.operator.planner.instance_pool import Pool
from gearshift.operator.planner.latency_model import LatencyModel
from gearshift.operator.router.server import load_tokenizer
from gearshift.operator.router.tetris_requests import TetrisPlanningError, TetrisRequestPlanner
from gearshift.v1 import policy_pb2, worker_pb2
from gearshift.worker.tokenizer import Tokenizer
from tests.router.fake_worker import Script
from tests.router.test_router_routing import Setup, run

MODEL = "fake"  # the routing fixture's served model name
MODELS = {
    1: (0.01, 1e-3, 1e-8, 1e-7),
    2: (0.02, 5e-4, 5e-9, 5e-8),
    4: (0.04, 2.5e-4, 2.5e-9, 2.5e-8),
}
PREFILL, DECODE = worker_pb2.InstanceStats.PREFILL, worker_pb2.InstanceStats.DECODE


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer("smollm2")


def _policy(**kw: object) -> policy_pb2.Policy:
    tetris = policy_pb2.TetrisPolicy(
        prefill_instances=4,
        max_sp=4,
        power_of_two_sp=True,
        chunk_granularity=64,
        max_chunks=2,
        improvement_rate=0.3,
        rate_window_seconds=30,
        decode_placement=policy_pb2.TetrisPolicy.FREENESS,
        **kw,  # type: ignore[arg-type]
    )
    if "latency_models" not in kw:
        for sp, (a, b, c, d) in MODELS.items():
            tetris.latency_models.add(sp=sp, a=a, b=b, c=c, d=d)
    return policy_pb2.Policy(tetris=tetris)


def _stats(queues: list[float], free: list[int], policy: policy_pb2.Policy | None = None):
    stats = worker_pb2.WorkerStats(policy=policy or _policy())
    for i, q in enumerate(queues):
        stats.instances.add(role=PREFILL, index=i, queued_seconds=q, node=i // 2)
    for i, f in enumerate(free):
        stats.instances.add(role=DECODE, index=i, kv_slots_free=f)
    return stats


def _reference(length: int, queues: list[float]):
    rules = PlannerRules({sp: LatencyModel(sp, *m) for sp, m in MODELS.items()}, 64, 2)
    return plan_request(length, Pool(dict(enumerate(queues)), (0, 0, 1, 1)), rules, 0.3)


def _chunks(plan: worker_pb2.TetrisPlan) -> list[tuple[int, tuple[int, ...]]]:
    return [(c.num_tokens, tuple(c.prefill_instances)) for c in plan.chunks]


def test_plans_follow_the_planner_then_the_routers_own_bookings_until_the_next_poll():
    now = [100.0]
    planner = TetrisRequestPlanner(clock=lambda: now[0])
    queues = [0.0, 2.0, 0.5, 3.0]
    stats = _stats(queues, [5000, 4500])
    first = planner.plan(stats, 2000, 16)
    want = _reference(2000, queues)
    assert _chunks(first) == [(c.length, c.group) for c in want.chunks]
    assert first.decode_instance == 0  # both idle: more free slots wins
    # Same poll, 0.2 s later: the first plan's chunks keep their instances busy (Eq. (2)).
    now[0] += 0.2
    second = planner.plan(stats, 2000, 16)
    booked = Pool(dict(enumerate(queues)), (0, 0, 1, 1)).commit(
        (c.group, c.end) for c in want.chunks
    )
    rules = PlannerRules({sp: LatencyModel(sp, *m) for sp, m in MODELS.items()}, 64, 2)
    again = plan_request(2000, booked.advance(0.2), rules, 0.3)
    assert _chunks(second) == [(c.length, c.group) for c in again.chunks]
    # Decode 0 now carries the first request's 2016 slots as virtual usage: decode 1 is freer.
    assert second.decode_instance == 1
    # A new poll replaces the router's view.
    now[0] += 0.2
    third = planner.plan(_stats(queues, [5000, 4500]), 2000, 16)
    assert _chunks(third) == _chunks(first) and third.decode_instance == 0


def test_what_cannot_be_planned_is_refused_naming_why():
    planner = TetrisRequestPlanner()
    for stats, why in (
        (worker_pb2.WorkerStats(), "does not run the tetris policy"),
        (_stats([0.0] * 4, [10, 10], _policy(latency_models=[])), "latencyModels is empty"),
        (_stats([0.0] * 4, []), "0 decode instances"),
        (_stats([0.0] * 4, [10, 10]), "no decode instance has 2016 free KV slots"),
    ):
        try:
            planner.plan(stats, 2000, 16)
        except TetrisPlanningError as exc:
            assert why in str(exc), (why, exc)
        else:
            raise AssertionError(f"planned despite: {why}")


def test_requests_to_a_tetris_group_carry_their_plan(tokenizer: Tokenizer) -> None:
    async def scenario(s: Setup) -> None:
        worker = s.workers[0]
        worker.script = Script(tokens=[100, 101])
        worker.policy = _policy()
        worker.instances = list(_stats([0.0] * 4, [5000, 5000]).instances)
        await asyncio.sleep(0.4)  # a few stats polls
        r = await s.http.post("/v1/completions", json={"prompt": [7] * 400, "max_tokens": 2})
        assert r.status_code == 200, r.text
        plan = worker.requests[-1].tetris_plan
        assert sum(c.num_tokens for c in plan.chunks) == 400
        reference = _reference(400, [0.0] * 4)
        assert _chunks(plan) == [(c.length, c.group) for c in reference.chunks]
        assert plan.planned_prefill_seconds == pytest.approx(reference.ttft)
        # The router's metrics say what it planned: chunks, each chunk's SP size, the estimate,
        # and the decode instance.
        text = (await s.http.get("/metrics")).text
        sp_sizes = [len(c.prefill_instances) for c in plan.chunks]
        assert f'gearshift_tetris_plan_chunks_count{{model_name="{MODEL}"}} 1.0' in text
        assert (
            f'gearshift_tetris_chunk_sp_size_sum{{model_name="{MODEL}"}} {float(sum(sp_sizes))}'
            in text
        )
        assert (
            f'gearshift_tetris_decode_placements_total{{decode_instance="{plan.decode_instance}",'
            f'model_name="{MODEL}"}} 1.0'
        ) in text
        assert f'gearshift_tetris_planned_prefill_seconds_count{{model_name="{MODEL}"}} 1.0' in text
        assert plan.improvement_rate == pytest.approx(0.3)  # the policy's improvementRate
        assert plan.improvement_rate_source == worker_pb2.TetrisPlan.POLICY_CONSTANT
        assert (
            f'gearshift_tetris_improvement_rate_count{{model_name="{MODEL}",'
            f'source="policy_constant"}} 1.0'
        ) in text
        # Without Eq. (1) models the router sends no plan: the group plans one chunk itself.
        worker.policy = _policy(latency_models=[])
        await asyncio.sleep(0.4)
        r = await s.http.post("/v1/completions", json={"prompt": [7] * 400, "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert not worker.requests[-1].HasField("tetris_plan")
        # A group whose policy cannot be planned for: 503 naming why, nothing sent.
        worker.policy = _policy(latency_models=[policy_pb2.TetrisPolicy.LatencyModel(sp=1)])
        await asyncio.sleep(0.4)
        sent = len(worker.requests)
        r = await s.http.post("/v1/completions", json={"prompt": [7] * 400, "max_tokens": 2})
        assert r.status_code == 503 and "latencyModels" in r.text
        assert len(worker.requests) == sent

    run(tokenizer, scenario, groups=1)


def _fitted(stats: worker_pb2.WorkerStats, source: int) -> worker_pb2.WorkerStats:
    """The same group reporting MODELS as fitted at start (WorkerStats.tetris_models)."""
    stats.tetris_models.source = source  # type: ignore[assignment]
    for sp, (a, b, c, d) in MODELS.items():
        stats.tetris_models.models.add(sp=sp, a=a, b=b, c=c, d=d)
    return stats


def test_a_group_without_policy_models_is_planned_with_the_models_it_fitted_at_start():
    queues = [0.0, 2.0, 0.5, 3.0]
    bare = _policy(latency_models=[])
    fitted = _fitted(_stats(queues, [5000, 4500], bare), worker_pb2.TetrisModelStatus.AUTO_FITTED)
    wire = worker_pb2.WorkerGenerateRequest(prompt_token_ids=[7] * 2000)
    TetrisRequestPlanner().plan_into(fitted, wire, 16)
    want = _reference(2000, queues)
    assert _chunks(wire.tetris_plan) == [(c.length, c.group) for c in want.chunks]
    assert wire.tetris_plan.planned_prefill_seconds == pytest.approx(want.ttft)
    # The policy's own models win over fitted ones; models the group says are not usable
    # (NONE: its fit failed) are not taken, and the group gets no plan.
    scaled = _policy(
        latency_models=[
            policy_pb2.TetrisPolicy.LatencyModel(sp=sp, a=a * 2, b=b * 2, c=c * 2, d=d * 2)
            for sp, (a, b, c, d) in MODELS.items()
        ]
    )
    own = _fitted(_stats(queues, [5000, 4500], scaled), worker_pb2.TetrisModelStatus.AUTO_FITTED)
    wire = worker_pb2.WorkerGenerateRequest(prompt_token_ids=[7] * 2000)
    TetrisRequestPlanner().plan_into(own, wire, 16)
    assert wire.tetris_plan.planned_prefill_seconds != pytest.approx(want.ttft)
    failed = _fitted(_stats(queues, [5000, 4500], bare), worker_pb2.TetrisModelStatus.NONE)
    wire = worker_pb2.WorkerGenerateRequest(prompt_token_ids=[7] * 2000)
    TetrisRequestPlanner().plan_into(failed, wire, 16)
    assert not wire.HasField("tetris_plan")
