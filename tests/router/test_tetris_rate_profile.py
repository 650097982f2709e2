"""The improvement rate a Tetris group gets when its policy sets neither ``improvementRate`` nor
``improvementRateTable`` (Tetris §5.1's simulator-based search, router/tetris_rate_profile.py):
the router profiles a table from the group's models and the prompts it planned, and plans with
it; a rate or a table set in the policy is used as set."""

from __future__ import annotations

import pytest

from gearshift.operator.planner.cdsp import PlannerRules
from gearshift.operator.planner.latency_model import LatencyModel
from gearshift.operator.router import tetris_rate_profile
from gearshift.operator.router.tetris_rate_profile import RateProfiler
from gearshift.operator.router.tetris_requests import TetrisRequestPlanner
from gearshift.v1 import policy_pb2, worker_pb2

PREFILL, DECODE = worker_pb2.InstanceStats.PREFILL, worker_pb2.InstanceStats.DECODE
# SP 2 prefills 20% faster than SP 1: under the 0.3 default, over 0.0 or 0.1 (Alg. 2 line 13).
MODELS = {1: (0.0, 1e-3, 0.0, 0.0), 2: (0.0, 0.8e-3, 0.0, 0.0)}


def _stats(models: dict[int, tuple[float, ...]] = MODELS, **kw: object) -> worker_pb2.WorkerStats:
    tetris = policy_pb2.TetrisPolicy(
        prefill_instances=2,
        max_sp=2,
        power_of_two_sp=True,
        chunk_granularity=64,
        max_chunks=1,
        rate_window_seconds=30,
        decode_placement=policy_pb2.TetrisPolicy.FREENESS,
        **kw,  # type: ignore[arg-type]
    )
    for sp, (a, b, c, d) in models.items():
        tetris.latency_models.add(sp=sp, a=a, b=b, c=c, d=d)
    stats = worker_pb2.WorkerStats(policy=policy_pb2.Policy(tetris=tetris))
    for i in range(2):
        stats.instances.add(role=PREFILL, index=i, node=0)
    stats.instances.add(role=DECODE, index=0, kv_slots_free=1 << 20)
    return stats


def _sp(plan: worker_pb2.TetrisPlan) -> int:
    (chunk,) = plan.chunks
    return len(chunk.prefill_instances)


def test_without_a_rate_the_router_profiles_one_and_takes_the_faster_sp() -> None:
    now = [0.0]
    planner = TetrisRequestPlanner(clock=lambda: now[0])
    plan = planner.plan(_stats(), 2000, 4)
    # At one request per 30 s the profiled table's rate lets the 20%-faster SP 2 be taken.
    assert plan.improvement_rate_source == worker_pb2.TetrisPlan.PROFILED
    assert plan.improvement_rate < 0.2
    assert _sp(plan) == 2
    # The policy's constant 0.3, set: SP 2's 20% is not enough, SP 1 runs it.
    constant = TetrisRequestPlanner(clock=lambda: now[0]).plan(
        _stats(improvement_rate=0.3), 2000, 4
    )
    assert constant.improvement_rate_source == worker_pb2.TetrisPlan.POLICY_CONSTANT
    assert constant.improvement_rate == pytest.approx(0.3) and _sp(constant) == 1
    # A table in the policy: its row, not a profiled one.
    table = [policy_pb2.TetrisPolicy.ImprovementRateStep(request_rate=0.0, improvement_rate=0.5)]
    tabled = TetrisRequestPlanner(clock=lambda: now[0]).plan(
        _stats(improvement_rate_table=table), 2000, 4
    )
    assert tabled.improvement_rate_source == worker_pb2.TetrisPlan.POLICY_TABLE
    assert tabled.improvement_rate == pytest.approx(0.5) and _sp(tabled) == 1


def test_the_profiled_rate_rises_with_the_load_the_table_was_profiled_for() -> None:
    rules = PlannerRules({sp: LatencyModel(sp, *m) for sp, m in MODELS.items()}, 64, 1)
    table = tetris_rate_profile.profile(rules, (0, 0), [2000] * 8)
    assert [round(r.request_rate, 6) for r in table] == [
        round(load * 2 / 2.0, 6) for load in tetris_rate_profile.LOADS
    ]  # the pool's SP-1 capacity for 2000-token prompts: 2 instances / 2 s
    rates = [r.improvement_rate for r in table]
    # Light load: SP 2's 20% pays. At the pool's capacity the queue does not let one request
    # hold both instances: a rate of 0.2 or more keeps SP 1 (§7.1, Fig. 11-12; "more than").
    assert rates[0] < 0.2 <= rates[-1], rates


def test_profiles_run_at_the_first_second_fourth_prompt_then_every_window() -> None:
    rules = PlannerRules({sp: LatencyModel(sp, *m) for sp, m in MODELS.items()}, 64, 1)
    profiler = RateProfiler()
    due = [i for i in range(1, 600) if profiler.observe(100 + i, rules, (0, 0)) is not None]
    assert due == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert len(profiler.lengths) == tetris_rate_profile.WINDOW  # the last WINDOW prompts
    assert profiler.lengths[-1] == 100 + 599


def test_new_models_are_profiled_again_at_the_next_request() -> None:
    now = [0.0]
    planner = TetrisRequestPlanner(clock=lambda: now[0])
    for _ in range(3):  # profiles at the 1st and 2nd prompt; the 3rd uses the 2nd's table
        planner.plan(_stats(), 2000, 4)
    assert planner._profiler.profiles == 2
    slower = {1: MODELS[1], 2: (0.0, 0.95e-3, 0.0, 0.0)}  # SP 2 now only 5% faster
    plan = planner.plan(_stats(slower), 2000, 4)
    assert planner._profiler.profiles == 3
    assert plan.improvement_rate_source == worker_pb2.TetrisPlan.PROFILED


def test_a_changed_pool_is_profiled_again() -> None:
    planner = TetrisRequestPlanner(clock=lambda: 0.0)
    for _ in range(3):
        planner.plan(_stats(), 2000, 4)
    assert planner._profiler.profiles == 2
    moved = _stats()
    moved.instances[1].node = 1  # the second prefill instance now reports another node
    planner.plan(moved, 2000, 4)
    assert planner._profiler.profiles == 3


def test_a_profile_that_fails_keeps_the_rate_in_force(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object) -> None:
        raise ValueError("no table")

    monkeypatch.setattr(tetris_rate_profile, "profile", broken)
    plan = TetrisRequestPlanner(clock=lambda: 0.0).plan(_stats(), 2000, 4)
    # Planned all the same, at the rate in force before any table: 0.3, which keeps SP 1.
    assert plan.improvement_rate_source == worker_pb2.TetrisPlan.DEFAULT
    assert plan.improvement_rate == pytest.approx(0.3) and _sp(plan) == 1
