"""Tetris's request-rate → improvement-rate table from simulation (Tetris §5.1, §7.1; issue 16,
item 3): the prefill pool under Poisson arrivals, each request planned by the real planner
(``operator/planner``: Algorithm 1 and the Eq. (2) bookings the router makes), for each candidate
improvement rate; per request rate, the improvement rate with the lowest mean TTFT wins.

Only prefill is modelled (TTFT is a prefill figure): a request's TTFT is its plan's end, queueing
included, under the same Eq. (1) models the planner plans with, so the table reflects the
planner's own view of the pool, as the paper profiles it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gearshift.operator.planner.cdsp import PlannerRules, plan_request
from gearshift.operator.planner.improvement_rate import RateStep
from gearshift.operator.planner.instance_pool import Pool
from gearshift.operator.sim.lengths import Lengths

IMPROVEMENT_RATES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7)


@dataclass(frozen=True)
class PoolShape:
    """The prefill pool: ``instances`` instances, ``per_node`` to a node."""

    instances: int
    per_node: int = 8


def mean_ttft(
    rules: PlannerRules,
    pool: PoolShape,
    lengths: Lengths,
    request_rate: float,
    improvement_rate: float,
    requests: int = 300,
    seed: int = 0,
) -> float:
    """Mean planned TTFT (seconds) of ``requests`` Poisson arrivals at ``request_rate``."""
    ttfts = planned_ttfts(rules, pool, lengths, request_rate, improvement_rate, requests, seed)
    return sum(ttfts) / requests


def planned_ttfts(
    rules: PlannerRules,
    pool: PoolShape,
    lengths: Lengths,
    request_rate: float,
    improvement_rate: float,
    requests: int = 300,
    seed: int = 0,
) -> list[float]:
    """Each request's planned TTFT (seconds), ``requests`` Poisson arrivals at ``request_rate``."""
    rng = np.random.default_rng([seed, 1])
    gaps = rng.exponential(1.0 / request_rate, requests)
    sizes = lengths.sample(requests, np.random.default_rng([seed, 2]))
    state = Pool.uniform([0.0] * pool.instances, pool.per_node)
    out = []
    for gap, length in zip(gaps, sizes, strict=True):
        state = state.advance(float(gap))  # Eq. (2): queues drain while no request arrives
        plan = plan_request(int(length), state, rules, improvement_rate)
        out.append(plan.ttft)
        state = state.commit((c.group, c.end) for c in plan.chunks)
    return out


def rate_table(
    rules: PlannerRules,
    pool: PoolShape,
    lengths: Lengths,
    request_rates: Sequence[float],
    improvement_rates: Sequence[float] = IMPROVEMENT_RATES,
    requests: int = 300,
    seed: int = 0,
) -> tuple[list[RateStep], dict[float, dict[float, float]]]:
    """The table (one row per request rate) and every mean TTFT it was chosen from."""
    table, seen = [], {}
    for rate in request_rates:
        means = {
            imp: mean_ttft(rules, pool, lengths, rate, imp, requests, seed)
            for imp in improvement_rates
        }
        seen[rate] = means
        best = min(improvement_rates, key=lambda imp: (means[imp], imp))
        table.append(RateStep(rate, best))
    return table, seen


def policy_rows(table: Sequence[RateStep]) -> list[dict[str, float]]:
    """The table as a TetrisPolicy's ``improvementRateTable`` (the CRD's camelCase)."""
    return [{"requestRate": r.request_rate, "improvementRate": r.improvement_rate} for r in table]
