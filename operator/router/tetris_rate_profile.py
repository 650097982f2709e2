"""The router's own improvement-rate table for a Tetris group whose policy sets neither
``improvementRate`` nor ``improvementRateTable`` (Tetris §5.1, "real-time load-aware improvement
rate"; §7.1).

The paper profiles, for each request rate, the improvement rate whose simulated TTFT is lowest,
from the Eq. (1) models the scheduler plans with and the service's collected length
distribution, and updates the table as that distribution is collected again. The router does the
same with what it has: the group's models (its policy's, or fitted at start), its prefill pool,
and the prompt lengths it planned for the group (the last ``WINDOW``). The request rates span
the pool's SP-1 capacity for those lengths (``LOADS``). ``operator/sim/tetris_rates.py`` is the
simulator, the one ``gearshift plan`` tunes its Tetris candidates with.

A profile took 0.05–0.1 s of the router's time here (3 to 16 instances). It runs at the 1st,
2nd, 4th, ... planned prompt and then every ``WINDOW`` prompts, so the table follows the traffic
early and costs little later; again when the models, the policy or the pool change. A profile
that fails is logged and the rate in force stays.
"""

from __future__ import annotations

import logging
import statistics
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from gearshift.operator.planner.cdsp import PlannerRules
from gearshift.operator.planner.improvement_rate import RateStep

log = logging.getLogger(__name__)

WINDOW = 256  # prompt lengths kept; after the first WINDOW prompts, one profile per WINDOW
LOADS = (0.1, 0.25, 0.5, 0.75, 1.0)  # request rates, as fractions of the pool's SP-1 capacity
REQUESTS = 100  # simulated Poisson arrivals per (request rate, improvement rate)


def profile(rules: PlannerRules, nodes: Sequence[int], lengths: Sequence[int]) -> list[RateStep]:
    """The table for a pool whose instance i runs on node ``nodes[i]``, under ``lengths``."""
    # The simulator (and numpy) only when a profile runs: not on every request's planning path.
    from gearshift.operator.sim.lengths import Observed
    from gearshift.operator.sim.tetris_rates import PoolShape, rate_table

    smallest = rules.sizes[0]  # SP 1 unless the models start higher
    model = rules.models[smallest]
    mean_s = statistics.fmean(max(model.seconds(0.0, n), 1e-6) for n in lengths)
    capacity = max(1, len(nodes) // smallest) / mean_s  # requests/s the pool sustains at it
    per_node = max(Counter(nodes).values())
    table, _ = rate_table(
        rules,
        PoolShape(len(nodes), per_node),
        Observed(tuple(lengths)),
        [capacity * load for load in LOADS],
        requests=REQUESTS,
    )
    return table


@dataclass
class RateProfiler:
    """The prompt lengths planned for one group, and when the next profile is due."""

    lengths: deque[int] = field(default_factory=lambda: deque(maxlen=WINDOW))
    seen: int = 0
    due_at: int = 1
    profiles: int = 0

    def renew(self) -> None:
        """Profile again at the next prompt (the models or the pool changed)."""
        self.due_at = self.seen + 1

    def observe(
        self, prompt_tokens: int, rules: PlannerRules, nodes: Sequence[int]
    ) -> list[RateStep] | None:
        """Record one planned prompt; a new table when a profile is due, else None."""
        self.lengths.append(prompt_tokens)
        self.seen += 1
        if self.seen < self.due_at:
            return None
        self.due_at = 2 * self.seen if self.seen < WINDOW else self.seen + WINDOW
        self.profiles += 1
        try:
            return profile(rules, nodes, tuple(self.lengths))
        except (ValueError, ZeroDivisionError, OverflowError) as exc:
            # A profile that cannot run keeps the rate in force: it never stops planning.
            log.warning("tetris improvement-rate profile failed, keeping the current rate: %s", exc)
            return None
