"""The load-aware improvement rate of Algorithm 2 (Tetris §5.1, §7.1).

The router counts request arrivals over a sliding window; every ``window`` seconds the rate is
re-picked from the profiled table (the row whose request rate is nearest the observed one), or
the constant when no table is set. Time is passed in, so tests need no clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RateStep:
    """One profiled row: at this request rate (req/s), this improvement rate was best."""

    request_rate: float
    improvement_rate: float


def pick_improvement_rate(table: Sequence[RateStep], observed_rate: float, default: float) -> float:
    """The table row nearest ``observed_rate`` (ties: the lower request rate), else ``default``."""
    if not table:
        return default
    row = min(table, key=lambda r: (abs(r.request_rate - observed_rate), r.request_rate))
    return row.improvement_rate


class ImprovementRate:
    """Arrivals over the last ``window`` seconds and the improvement rate they select."""

    def __init__(self, table: Sequence[RateStep], default: float, window: float) -> None:
        if window <= 0:
            raise ValueError(f"rate_window_seconds must be positive, got {window}")
        self.table = tuple(table)
        self.default = default
        self.window = window
        self._arrivals: deque[float] = deque()
        self._current = default  # re-picked on the first ``current`` call
        self._picked_at: float | None = None

    def set_table(self, table: Sequence[RateStep]) -> None:
        """A new table, in force from the next ``current`` call (the window's arrivals stay)."""
        self.table = tuple(table)
        self._picked_at = None

    def record_arrival(self, now: float) -> None:
        self._arrivals.append(now)
        self._expire(now)

    def observed_rate(self, now: float) -> float:
        """Requests per second over the window ending at ``now``."""
        self._expire(now)
        return len(self._arrivals) / self.window

    def current(self, now: float) -> float:
        """The improvement rate in force at ``now``: re-picked once per window (§7.1)."""
        if self._picked_at is None or now - self._picked_at >= self.window:
            self._current = pick_improvement_rate(self.table, self.observed_rate(now), self.default)
            self._picked_at = now
        return self._current

    def _expire(self, now: float) -> None:
        cutoff = now - self.window
        while self._arrivals and self._arrivals[0] <= cutoff:
            self._arrivals.popleft()
