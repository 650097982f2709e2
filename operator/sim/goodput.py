"""Service-level objectives in vLLM's ``--goodput`` syntax (``ttft:500 tpot:50 e2el:3000``,
milliseconds), and whether a simulated run meets them (issue 16, item 3).

vLLM's benchmark counts a request as "good" when it meets every bound given. Ours judges a rate
point: it meets the SLO when at least ``share`` (default 90%) of its requests are good, and
nothing was refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from gearshift.operator.sim.replica import RequestTimes
from gearshift.operator.sim.results import SimResult

KEYS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class Goodput:
    """Bounds in seconds (None: not bounded)."""

    ttft: float | None = None
    tpot: float | None = None
    e2el: float | None = None
    share: float = 0.9

    @staticmethod
    def parse(text: str, share: float = 0.9) -> Goodput:
        """``"ttft:500 tpot:50"`` (ms, space- or comma-separated); refuses unknown keys and
        non-positive or non-numeric bounds, naming them."""
        bounds: dict[str, float] = {}
        for item in text.replace(",", " ").split():
            key, sep, value = item.partition(":")
            if not sep or key not in KEYS:
                raise ValueError(f"goodput: {item!r} is not KEY:MS with KEY one of {KEYS}")
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"goodput: {key} must be a number of ms, got {value!r}") from None
            if not 0 < ms < float("inf"):
                raise ValueError(f"goodput: {key} must be a finite number > 0 ms, got {value}")
            if key in bounds:
                raise ValueError(f"goodput: {key} given twice")
            bounds[key] = ms / 1000.0
        if not bounds:
            raise ValueError("goodput: give at least one bound, e.g. 'ttft:500 tpot:50'")
        if not 0.0 < share <= 1.0:
            raise ValueError(f"goodput share must be in (0, 1], got {share}")
        return Goodput(bounds.get("ttft"), bounds.get("tpot"), bounds.get("e2el"), share)

    def good(self, r: RequestTimes) -> bool:
        tpot = r.tpot
        return (
            (self.ttft is None or r.ttft <= self.ttft)
            and (self.tpot is None or tpot is None or tpot <= self.tpot)
            and (self.e2el is None or r.e2e <= self.e2el)
        )

    def good_share(self, result: SimResult) -> float:
        total = len(result.requests) + len(result.rejected)
        return sum(self.good(r) for r in result.requests) / total if total else 0.0

    def met(self, result: SimResult) -> bool:
        return not result.rejected and self.good_share(result) >= self.share

    def __str__(self) -> str:
        parts = [f"{k}:{v * 1000:g}" for k in KEYS if (v := getattr(self, k)) is not None]
        return " ".join(parts)
