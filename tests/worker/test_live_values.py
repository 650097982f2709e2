"""Repeated live fields (Tetris's latencyModels and improvementRateTable) change while a group
runs: the ApplyPolicy payload replaces their elements, crosses the engine pipe's codec, and the
policy refuses an element out of the proto's bounds naming it, changing nothing."""

from __future__ import annotations

import pytest

from gearshift.v1 import policy_pb2
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.policies.tetris.policy import TetrisPolicy
from gearshift.worker.server import convert
from gearshift.worker.server.engine_messages import TO_ENGINE, ApplyLive


def _tetris(models: list[tuple[int, float]]) -> policy_pb2.Policy:
    p = policy_pb2.Policy()
    p.tetris.prefill_instances = 2
    p.tetris.decode_instances = 1
    for sp, a in models:
        m = p.tetris.latency_models.add()
        m.sp, m.a, m.b = sp, a, 1e-3
    return p


def test_a_repeated_live_field_given_replaces_the_active_elements() -> None:
    active = _tetris([(1, 9.0)])
    values = convert.live_update(active, _tetris([(1, 0.5), (2, 0.25)]))
    assert list(values) == ["latency_models"]
    models = values["latency_models"]
    assert isinstance(models, tuple) and [(m["sp"], m["a"]) for m in models] == [  # type: ignore[index]
        (1, 0.5),
        (2, 0.25),
    ]
    # Not given: the active elements stay (nothing to change).
    unchanged = policy_pb2.Policy()
    unchanged.tetris.prefill_instances = 2
    assert convert.live_update(active, unchanged) == {}


def test_the_values_cross_the_engine_pipe_and_reach_the_policy() -> None:
    values = convert.live_update(_tetris([(1, 9.0)]), _tetris([(1, 0.5), (2, 0.25)]))
    values["improvement_rate_table"] = (
        {"request_rate": 1.0, "improvement_rate": 0.2},
        {"request_rate": 4.0, "improvement_rate": 0.5},
    )
    back = TO_ENGINE.decode(TO_ENGINE.encode(ApplyLive(values, 7)))
    assert isinstance(back, ApplyLive) and back.values == values
    policy = TetrisPolicy(_tetris([(1, 9.0)]), world_size=3)
    policy.update_live(back.values)
    out = policy.to_proto().tetris
    assert [(m.sp, m.a) for m in out.latency_models] == [(1, 0.5), (2, 0.25)]
    assert [round(r.improvement_rate, 3) for r in out.improvement_rate_table] == [0.2, 0.5]


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"latency_models": ({"sp": 0, "a": 1.0},)}, "tetris.latency_models[0].sp"),
        (
            {"improvement_rate_table": ({"request_rate": 1.0, "improvement_rate": 2.0},)},
            "tetris.improvement_rate_table[0].improvement_rate",
        ),
        ({"latency_models": ({"sp": 1, "speed": 1.0},)}, "tetris.latency_models[0]"),
        ({"latency_models": 3}, "tetris.latency_models"),
    ],
)
def test_a_bad_element_is_refused_naming_it_and_changes_nothing(
    values: dict[str, object], field: str
) -> None:
    policy = TetrisPolicy(_tetris([(1, 9.0)]), world_size=3)
    before = policy.to_proto()
    with pytest.raises(InvalidRequestError) as err:
        policy.update_live(values)  # type: ignore[arg-type]
    assert err.value.field == field
    assert policy.to_proto() == before
