"""The traffic the router saw lately (issue 30, item 4): a bounded sliding window of finished
requests, summarised for ``policy: auto``'s ``traffic.source: Observed``.

A request enters when it finishes (its arrival time, prompt and output token counts). The window
keeps at most ``max_requests`` of them and drops those that arrived more than ``max_age_s`` ago,
so memory is bounded and old traffic ages out. The summary estimates what
``operator/sim/traffic.Traffic`` needs: the rate as the inverse of the mean gap between
consecutive arrivals, ``(n - 1) / (last - first)`` (the maximum-likelihood rate of a renewal
process observed from its first arrival to its last), the burstiness as the gaps' coefficient of
variation (Gamma gaps of CV c: ``sim/arrivals.py``), and each length's median, 90th percentile and
range (a truncated lognormal from them: ``LogNormal.from_median_p90``). Only the router's one event
loop touches it.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# The defaults: long enough for a steady CV estimate at a few req/s, short enough to follow a
# change of traffic within minutes.
DEFAULT_MAX_REQUESTS = 2000
DEFAULT_MAX_AGE_S = 900.0


@dataclass(frozen=True)
class LengthSummary:
    median: float
    p90: float
    low: int
    high: int


@dataclass(frozen=True)
class TrafficSummary:
    """What the window holds (router.proto ``ObservedTraffic``)."""

    requests: int
    window_s: float  # first arrival to last
    rate: float  # requests/s; 0 below two requests
    burstiness: float  # CV of the gaps; 0 below three requests
    prompt: LengthSummary
    output: LengthSummary


@dataclass(frozen=True)
class _Finished:
    arrival: float  # time.monotonic() reading
    prompt_tokens: int
    output_tokens: int


def summarise_lengths(values: Sequence[int]) -> LengthSummary:
    """Median, 90th percentile (linear interpolation between order statistics) and range."""
    if not values:
        return LengthSummary(0.0, 0.0, 0, 0)
    ordered = sorted(values)
    return LengthSummary(
        float(statistics.median(ordered)), _quantile(ordered, 0.9), ordered[0], ordered[-1]
    )


def _quantile(ordered: Sequence[int], q: float) -> float:
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return float(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))


def estimate(
    arrivals: Sequence[float], prompts: Sequence[int], outputs: Sequence[int]
) -> TrafficSummary:
    """The window's figures from arrival times (any order) and token counts."""
    times = sorted(arrivals)
    n = len(times)
    span = times[-1] - times[0] if n else 0.0
    rate = (n - 1) / span if n >= 2 and span > 0 else 0.0
    cv = 0.0
    if n >= 3 and span > 0:
        gaps = [b - a for a, b in itertools.pairwise(times)]
        mean = span / len(gaps)
        # The population form: the gaps are the whole of what the window saw.
        cv = statistics.pstdev(gaps, mean) / mean
    return TrafficSummary(n, span, rate, cv, summarise_lengths(prompts), summarise_lengths(outputs))


@dataclass
class TrafficWindow:
    """The last ``max_requests`` finished requests that arrived within ``max_age_s``."""

    max_requests: int = DEFAULT_MAX_REQUESTS
    max_age_s: float = DEFAULT_MAX_AGE_S
    clock: Callable[[], float] = time.monotonic
    _rows: deque[_Finished] = field(init=False)

    def __post_init__(self) -> None:
        if self.max_requests < 3 or not self.max_age_s > 0:
            raise ValueError(
                f"traffic window: max_requests >= 3 and max_age_s > 0, got "
                f"{self.max_requests}, {self.max_age_s}"
            )
        self._rows = deque(maxlen=self.max_requests)

    def record(self, arrival: float, prompt_tokens: int, output_tokens: int) -> None:
        """One finished request; ``arrival`` is a ``clock()`` reading."""
        self._rows.append(_Finished(arrival, prompt_tokens, output_tokens))
        self._expire()

    def _expire(self) -> None:
        # Rows are in finishing order, so an old arrival can sit behind a newer one: the left
        # end is trimmed here, and summary() filters the rest.
        oldest = self.clock() - self.max_age_s
        while self._rows and self._rows[0].arrival < oldest:
            self._rows.popleft()

    def __len__(self) -> int:
        return len(self._rows)

    def summary(self) -> TrafficSummary:
        self._expire()
        oldest = self.clock() - self.max_age_s
        rows = [r for r in self._rows if r.arrival >= oldest]
        return estimate(
            [r.arrival for r in rows],
            [r.prompt_tokens for r in rows],
            [r.output_tokens for r in rows],
        )
