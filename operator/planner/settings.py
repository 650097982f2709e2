"""The Tetris planner's parameters, read from a defaults-filled ``TetrisPolicy`` proto.

Every planner field is honoured or refused here with the field's name: SP candidates without a
latency model, duplicate models and an empty model list are errors, never silently skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

from gearshift.operator.planner.cdsp import PlannerRules, sp_sizes
from gearshift.operator.planner.decode_placement import Placement
from gearshift.operator.planner.improvement_rate import ImprovementRate, RateStep
from gearshift.operator.planner.latency_model import LatencyModel
from gearshift.v1 import policy_pb2

DEFAULT_IMPROVEMENT_RATE = 0.3  # Algorithm 2's rate before any table (the paper's 0.05-0.75 range)


@dataclass(frozen=True)
class PlannerSettings:
    """What the router's Tetris planner runs with."""

    rules: PlannerRules
    improvement_rate: float
    rate_table: tuple[RateStep, ...]
    rate_window_seconds: float
    placement: Placement
    # Neither improvementRate nor improvementRateTable is set: the router profiles the table
    # itself (router/tetris_rate_profile.py, §5.1) and uses DEFAULT_IMPROVEMENT_RATE until then.
    profile_rates: bool = False

    @staticmethod
    def from_proto(msg: policy_pb2.TetrisPolicy) -> PlannerSettings:
        """From a ``TetrisPolicy`` whose defaults are filled (``policy_fields.with_defaults``)."""
        models: dict[int, LatencyModel] = {}
        for m in msg.latency_models:
            if m.sp in models:
                raise ValueError(f"policy.tetris.latencyModels: SP size {m.sp} appears twice")
            models[m.sp] = LatencyModel(m.sp, m.a, m.b, m.c, m.d)
        if not models:
            raise ValueError(
                "policy.tetris.latencyModels is empty: the planner needs Eq. (1) coefficients "
                "per SP size (`gearshift tetris-profile` measures them)"
            )
        sizes = sp_sizes(msg.max_sp, msg.power_of_two_sp)
        missing = [s for s in sizes if s not in models]
        if missing:
            raise ValueError(
                f"policy.tetris.latencyModels: no model for SP sizes {missing} that maxSp "
                f"{msg.max_sp} and powerOfTwoSp allow"
            )
        rules = PlannerRules({s: models[s] for s in sizes}, msg.chunk_granularity, msg.max_chunks)
        placement = msg.decode_placement or policy_pb2.TetrisPolicy.FREENESS
        return PlannerSettings(
            rules=rules,
            improvement_rate=(
                msg.improvement_rate
                if msg.HasField("improvement_rate")
                else DEFAULT_IMPROVEMENT_RATE
            ),
            profile_rates=not msg.HasField("improvement_rate") and not msg.improvement_rate_table,
            rate_table=tuple(
                RateStep(r.request_rate, r.improvement_rate) for r in msg.improvement_rate_table
            ),
            rate_window_seconds=float(msg.rate_window_seconds),
            placement=Placement(placement),
        )

    def rate_tracker(self) -> ImprovementRate:
        """A fresh sliding-window tracker that picks the improvement rate by request rate."""
        return ImprovementRate(self.rate_table, self.improvement_rate, self.rate_window_seconds)
