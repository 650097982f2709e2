"""Token-length distributions for synthetic traces: fixed, uniform, lognormal, and presets.

Every distribution draws integers in ``[low, high]``; a lognormal is truncated there by inverse
CDF sampling (not by clipping, which would pile mass on the bounds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Protocol

import numpy as np

from gearshift.operator.sim.trace import TraceError

_N = NormalDist()
_Z90 = _N.inv_cdf(0.9)


class Lengths(Protocol):
    def sample(self, count: int, rng: np.random.Generator) -> list[int]: ...


@dataclass(frozen=True)
class Fixed:
    tokens: int

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise TraceError(f"a fixed length must be >= 1, got {self.tokens}")

    def sample(self, count: int, rng: np.random.Generator) -> list[int]:
        return [self.tokens] * count


@dataclass(frozen=True)
class Uniform:
    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise TraceError(f"uniform lengths need 1 <= low <= high, got {self.low}, {self.high}")

    def sample(self, count: int, rng: np.random.Generator) -> list[int]:
        return [int(x) for x in rng.integers(self.low, self.high + 1, count)]


@dataclass(frozen=True)
class Observed:
    """Lengths seen in traffic, drawn with replacement (the empirical distribution)."""

    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.lengths or min(self.lengths) < 1:
            raise TraceError("observed lengths need at least one length, each >= 1")

    def sample(self, count: int, rng: np.random.Generator) -> list[int]:
        picks = rng.integers(0, len(self.lengths), count)
        return [self.lengths[int(i)] for i in picks]


@dataclass(frozen=True)
class LogNormal:
    """exp(N(mu, sigma²)) truncated to [low, high] and rounded."""

    mu: float
    sigma: float
    low: int = 1
    high: int = 1 << 20

    def __post_init__(self) -> None:
        if self.sigma <= 0 or not 1 <= self.low < self.high:
            raise TraceError("lognormal lengths need sigma > 0 and 1 <= low < high")

    @classmethod
    def from_median_p90(cls, median: float, p90: float, low: int, high: int) -> LogNormal:
        """The lognormal with this median and 90th percentile (before truncation)."""
        return cls(math.log(median), math.log(p90 / median) / _Z90, low, high)

    @classmethod
    def with_mean(cls, mean: float, sigma: float, low: int, high: int) -> LogNormal:
        """The truncated lognormal of shape ``sigma`` whose truncated mean is ``mean``."""
        if not low < mean < high:
            raise TraceError(f"the mean {mean} must lie inside ({low}, {high})")
        lo, hi = math.log(low) - 4 * sigma, math.log(high) + 4 * sigma
        for _ in range(100):  # bisection: the truncated mean grows with mu
            mid = (lo + hi) / 2
            if cls(mid, sigma, low, high).mean() < mean:
                lo = mid
            else:
                hi = mid
        return cls((lo + hi) / 2, sigma, low, high)

    def _bounds(self) -> tuple[float, float]:
        a = (math.log(self.low) - self.mu) / self.sigma
        b = (math.log(self.high) - self.mu) / self.sigma
        return _N.cdf(a), _N.cdf(b)

    def mean(self) -> float:
        """The truncated distribution's mean (before rounding)."""
        s, ln_a, ln_b = self.sigma, math.log(self.low), math.log(self.high)
        mass = _N.cdf((ln_b - self.mu) / s) - _N.cdf((ln_a - self.mu) / s)
        part = _N.cdf((ln_b - self.mu - s * s) / s) - _N.cdf((ln_a - self.mu - s * s) / s)
        return math.exp(self.mu + s * s / 2) * part / mass

    def sample(self, count: int, rng: np.random.Generator) -> list[int]:
        pa, pb = self._bounds()
        # Keep u strictly inside (0, 1): inv_cdf refuses the ends.
        u = np.clip(rng.uniform(pa, pb, count), 1e-12, 1 - 1e-12)
        out = [round(math.exp(self.mu + self.sigma * _N.inv_cdf(float(x)))) for x in u]
        return [min(max(x, self.low), self.high) for x in out]


# Presets: (prompt lengths, output lengths). The chat and summarisation fits match the medians and
# 90th percentiles that Sarathi-Serve (Agrawal et al., OSDI 2024, Table 3) reports for
# openchat_sharegpt4 (prompt 1730 / 5696, output 415 / 834) and arxiv-summarization (prompt
# 7059 / 12985, output 208 / 371) — the two datasets Seesaw evaluates on (§6). They are fits of
# published summary statistics, not samples of the data sets.
def sharegpt() -> tuple[LogNormal, LogNormal]:
    return (
        LogNormal.from_median_p90(1730, 5696, 4, 16384),
        LogNormal.from_median_p90(415, 834, 1, 4096),
    )


def arxiv_summarization() -> tuple[LogNormal, LogNormal]:
    return (
        LogNormal.from_median_p90(7059, 12985, 256, 32768),
        LogNormal.from_median_p90(208, 371, 1, 2048),
    )


# Tetris §7.1 gives each production trace's range and mean of the sequence length, nothing more:
# Short 4k–95k (mean 23.6k), Medium 8k–142k (32.8k), Long 16k–190k (50.1k). We fit a lognormal of
# shape sigma = 1 truncated to the range with that mean (the shape is our assumption). The paper
# gives no output lengths (it measures TTFT and TBT), so callers pick those.
TETRIS = {"short": (4_000, 95_000, 23_600), "medium": (8_000, 142_000, 32_800)}
TETRIS["long"] = (16_000, 190_000, 50_100)


def tetris(name: str) -> LogNormal:
    if name not in TETRIS:
        raise TraceError(f"unknown Tetris trace {name!r}; one of {', '.join(TETRIS)}")
    low, high, mean = TETRIS[name]
    return LogNormal.with_mean(mean, 1.0, low, high)
