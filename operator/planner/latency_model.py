"""Tetris's prefill latency model, Eq. (1): T_s = a + b·L + c·(C·L) + d·L² for one SP size s.

L is the chunk's tokens and C its history (earlier chunks' tokens); the terms stand for fixed
overhead, the linear layers, attention to the history and attention within the chunk (§5.1).
Coefficients are fitted by least squares from measured (C, L, seconds) samples. Solving the model
for the largest L that fits a latency budget is Algorithm 3's ``SolvePerformanceModel``; Eq. (1)
is quadratic in L, so the root is taken in closed form rather than by Newton's method.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class LatencyModel:
    """Eq. (1) for one SP size: seconds to prefill L tokens after C history tokens."""

    sp: int
    a: float
    b: float
    c: float
    d: float

    def seconds(self, history: float, length: float) -> float:
        return self.a + length * (self.b + self.c * history + self.d * length)

    def max_length(self, budget: float, history: float) -> float:
        """Largest L >= 0 with ``seconds(history, L) <= budget`` (inf when L is unbounded, 0 when
        even an empty chunk overruns the budget)."""
        lin = self.b + self.c * history
        const = self.a - budget
        d = self.d
        if const > 0:
            return 0.0
        if d > 0:
            # d·L² + lin·L + const = 0 with const <= 0 has one root >= 0; for lin > 0 it is
            # written so that it does not cancel when d·L² is tiny next to lin·L.
            root = math.sqrt(lin * lin - 4.0 * d * const)
            return (-2.0 * const) / (lin + root) if lin > 0 else (root - lin) / (2.0 * d)
        if d == 0:
            return -const / lin if lin > 0 else math.inf
        # d < 0 (a fit outside its data): the model rises, then falls; the budget holds up to
        # the first root, or everywhere when the model never reaches it.
        disc = lin * lin - 4.0 * d * const
        if lin <= 0 or disc < 0:
            return math.inf
        return (lin - math.sqrt(disc)) / (-2.0 * d)


def fit_latency_model(sp: int, samples: Iterable[tuple[float, float, float]]) -> LatencyModel:
    """Least-squares Eq. (1) from (C, L, seconds) samples (§5.1: fitted offline per SP size)."""
    # The fit is offline (numpy); the group's own start-up fit uses the same function.
    from gearshift.worker.policies.tetris.latency_fit import fit_eq1

    return LatencyModel(sp, *fit_eq1(samples))
