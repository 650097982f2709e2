"""Arrival times: Poisson or Gamma (bursty) renewal processes at a rate or a piecewise rate curve.

Gamma inter-arrival gaps with coefficient of variation CV have shape 1/CV² (CV = 1 is Poisson;
CV > 1 is burstier), the burstiness knob of vLLM's benchmark_serving and of DistServe. A rate curve
is handled by time rescaling: arrivals of a unit-rate process in "operational time" Λ(t) = ∫ rate
are mapped back through Λ⁻¹, which gives exactly a non-homogeneous Poisson process for CV = 1.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from gearshift.operator.sim.trace import TraceError


@dataclass(frozen=True)
class RateCurve:
    """Piecewise-constant rate: ``rates[i]`` requests/s from ``starts[i]`` to the next start."""

    starts: tuple[float, ...]
    rates: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.starts or len(self.starts) != len(self.rates) or self.starts[0] != 0:
            raise TraceError("a rate curve needs matching starts and rates, the first start at 0")
        if any(b <= a for a, b in zip(self.starts, self.starts[1:], strict=False)):
            raise TraceError("rate curve starts must increase")
        if any(r < 0 for r in self.rates) or self.rates[-1] <= 0:
            raise TraceError("rates must be >= 0 and the last one > 0 (so arrivals never stop)")

    @classmethod
    def constant(cls, rate: float) -> RateCurve:
        return cls((0.0,), (rate,))

    def _cumulative(self) -> list[float]:
        """Λ at each segment start."""
        out = [0.0]
        for i in range(1, len(self.starts)):
            out.append(out[-1] + self.rates[i - 1] * (self.starts[i] - self.starts[i - 1]))
        return out

    def invert(self, work: float) -> float:
        """Λ⁻¹(work): the time by which ``work`` expected arrivals have happened."""
        cum = self._cumulative()
        i = bisect.bisect_right(cum, work) - 1
        # Skip zero-rate segments: no work is done in them.
        while self.rates[i] == 0:
            i += 1
        return self.starts[i] + (work - cum[i]) / self.rates[i]


@dataclass(frozen=True)
class Arrivals:
    """A renewal process: gaps of mean 1 in operational time, CV ``cv`` (1 = Poisson)."""

    curve: RateCurve
    cv: float = 1.0

    def __post_init__(self) -> None:
        if self.cv <= 0:
            raise TraceError(f"cv (burstiness) must be > 0, got {self.cv}")

    def times(self, count: int, rng: np.random.Generator) -> list[float]:
        """The first ``count`` arrival times in seconds."""
        if self.cv == 1.0:
            gaps = rng.exponential(1.0, count)
        else:
            shape = 1.0 / self.cv**2
            gaps = rng.gamma(shape, 1.0 / shape, count)
        work = np.cumsum(gaps)
        return [self.curve.invert(float(w)) for w in work]
