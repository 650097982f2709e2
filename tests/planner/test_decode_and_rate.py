"""Decode placement by freeness with virtual usage (§5.2), least-loaded and round-robin; the
improvement rate picked by the observed request rate (§5.1, §7.1); settings from the proto."""

from __future__ import annotations

import pytest

from gearshift.operator.planner.decode_placement import DecodeLoad, DecodePlacer, Placement
from gearshift.operator.planner.improvement_rate import (
    ImprovementRate,
    RateStep,
    pick_improvement_rate,
)
from gearshift.operator.planner.settings import PlannerSettings
from gearshift.v1 import policy_pb2
from gearshift.worker.policies.checks import with_defaults


def test_freeness_counts_in_flight_transfers_as_used():
    loads = [
        DecodeLoad(free_slots=1000, active=4),  # 250 per request
        DecodeLoad(free_slots=1200, active=4, in_flight_slots=600),  # 150 once transfers land
        DecodeLoad(free_slots=400, active=1),  # 400
    ]
    placer = DecodePlacer(Placement.FREENESS)
    assert placer.choose(loads, slots=100) == 2
    assert placer.choose(loads, slots=500) == 0  # instance 2 has no room; 1 has 600 available
    assert placer.choose(loads, slots=2000) is None
    assert placer.choose([DecodeLoad(10, 3), DecodeLoad(5, 0)], slots=5) == 1  # idle wins


def test_least_loaded_and_round_robin():
    loads = [DecodeLoad(100, 3), DecodeLoad(100, 1), DecodeLoad(100, 2, in_flight_slots=95)]
    assert DecodePlacer(Placement.LEAST_LOADED).choose(loads, 10) == 1
    rr = DecodePlacer(Placement.ROUND_ROBIN)
    # Instance 2 has 5 slots left: it is skipped while it cannot take the request.
    assert [rr.choose(loads, 10) for _ in range(4)] == [0, 1, 0, 1]
    assert [rr.choose(loads, 5) for _ in range(3)] == [2, 0, 1]


def test_the_improvement_rate_follows_the_request_rate_over_the_window():
    table = [RateStep(0.5, 0.5), RateStep(2.0, 0.3), RateStep(4.0, 0.1)]
    assert pick_improvement_rate(table, 1.9, 0.3) == 0.3
    assert pick_improvement_rate(table, 100.0, 0.3) == 0.1
    assert pick_improvement_rate([], 3.0, 0.25) == 0.25
    rate = ImprovementRate(table, default=0.3, window=10.0)
    assert rate.current(0.0) == 0.5  # no arrivals: 0 req/s, nearest row 0.5
    for i in range(40):  # 4 req/s for 10 s
        rate.record_arrival(1.0 + i * 0.25)
    assert rate.observed_rate(10.9) == pytest.approx(4.0)
    assert rate.current(5.0) == 0.5, "re-picked only once per window"
    assert rate.current(10.9) == 0.1
    assert rate.observed_rate(30.0) == 0.0  # every arrival left the window
    assert rate.current(21.0) == 0.5
    assert ImprovementRate([], 0.3, 30.0).current(0.0) == 0.3  # no table: the constant


def _tetris(**fields) -> policy_pb2.TetrisPolicy:
    policy = policy_pb2.Policy(tetris=policy_pb2.TetrisPolicy(**fields))
    return with_defaults(policy, group_gpus=5).tetris


def _models(*sizes: int) -> list[policy_pb2.TetrisPolicy.LatencyModel]:
    return [
        policy_pb2.TetrisPolicy.LatencyModel(sp=s, a=0.01, b=1e-5, c=1e-10, d=1e-10) for s in sizes
    ]


def test_settings_honour_the_proto_or_refuse_it_by_field():
    msg = _tetris(
        latency_models=_models(1, 2, 4),
        decode_placement=2,
        max_chunks=3,
        improvement_rate_table=[
            policy_pb2.TetrisPolicy.ImprovementRateStep(request_rate=1.0, improvement_rate=0.2)
        ],
    )
    settings = PlannerSettings.from_proto(msg)  # 4 prefill instances + 1 decode
    assert settings.rules.sizes == (1, 2, 4)
    assert settings.rules.max_chunks == 3 and settings.rules.chunk_granularity == 1024
    assert settings.placement is Placement.LEAST_LOADED
    assert settings.improvement_rate == pytest.approx(0.3)
    assert settings.rate_tracker().current(0.0) == pytest.approx(0.2)
    assert PlannerSettings.from_proto(_tetris(latency_models=_models(1, 2, 4))).placement is (
        Placement.FREENESS
    )
    with pytest.raises(ValueError, match=r"latencyModels: no model for SP sizes \[4\]"):
        PlannerSettings.from_proto(_tetris(latency_models=_models(1, 2)))
    with pytest.raises(ValueError, match="latencyModels is empty"):
        PlannerSettings.from_proto(_tetris())
    with pytest.raises(ValueError, match="appears twice"):
        PlannerSettings.from_proto(_tetris(latency_models=_models(1, 2, 2, 4)))
    # power_of_two_sp false: every size up to max_sp needs a model.
    with pytest.raises(ValueError, match=r"\[3\]"):
        PlannerSettings.from_proto(_tetris(latency_models=_models(1, 2, 4), power_of_two_sp=False))
