"""Tetris's request-rate → improvement-rate table from simulation with the real planner (§5.1,
§7.1): an idle pool wants the largest SP (rate 0), a loaded one a higher improvement rate (the
paper's reason for the table: expansion under load delays the requests behind), and the rows
load as a TetrisPolicy's improvementRateTable."""

from __future__ import annotations

import pytest

from gearshift.operator.planner.cdsp import PlannerRules, sp_sizes
from gearshift.operator.planner.latency_model import LatencyModel
from gearshift.operator.planner.settings import PlannerSettings
from gearshift.operator.sim.lengths import tetris
from gearshift.operator.sim.tetris_rates import PoolShape, policy_rows, rate_table
from gearshift.v1 import policy_pb2


def _model(sp: int) -> LatencyModel:
    """Shaped after the paper's Table 1 (as benchmarks/tetris.py)."""
    return LatencyModel(sp, 0.023 * sp, 6.5e-5 / sp, 2.4e-9 / sp, 1.2e-9 / sp)


def test_the_improvement_rate_grows_with_the_request_rate() -> None:
    rules = PlannerRules({s: _model(s) for s in sp_sizes(8, True)}, 1024, 4)
    rates = [0.1, 1.0, 2.0, 3.0, 3.5]
    table, seen = rate_table(rules, PoolShape(8), tetris("short"), rates, requests=400)
    picked = [row.improvement_rate for row in table]
    assert picked[0] == 0.0  # nearly idle: the largest SP that helps at all
    assert picked == sorted(picked) and picked[-1] >= 0.3, picked
    for row in table:  # each pick is the lowest mean TTFT of its row
        assert seen[row.request_rate][row.improvement_rate] == min(seen[row.request_rate].values())
    # Under load the difference is large: expanding freely at 3 req/s multiplies the mean TTFT.
    assert seen[3.0][0.0] > 3 * seen[3.0][picked[3]]
    policy = policy_pb2.TetrisPolicy(
        max_sp=1, chunk_granularity=1024, max_chunks=4, rate_window_seconds=30
    )
    for row in policy_rows(table):
        policy.improvement_rate_table.add(
            request_rate=row["requestRate"], improvement_rate=row["improvementRate"]
        )
    policy.latency_models.add(sp=1, a=0.023, b=6.5e-5, c=2.4e-9, d=1.2e-9)
    settings = PlannerSettings.from_proto(policy)
    assert [s.improvement_rate for s in settings.rate_table] == pytest.approx(picked)
