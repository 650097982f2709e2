"""Shift Parallelism's per-step gear choice (Shift §3.3, Alg. 3).

Two gears share one KV cache: the base gear (Ulysses SP x TP) for large batches and the shift
gear (full TP over the same ranks) for small ones. A step whose scheduled token count, prefill
chunks included, exceeds the threshold runs the base gear; otherwise the shift gear.
"""

from __future__ import annotations

from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.policies.base import GearPolicy, LiveValue

BASE, SHIFT = 0, 1
DEFAULT_THRESHOLD = 256


class ShiftPolicy(GearPolicy):
    kind = "shift"

    def __init__(self, sp: int, tp: int = 1, threshold: int = DEFAULT_THRESHOLD) -> None:
        self.sp, self.tp = sp, tp
        self._check_live("threshold", threshold)
        self.threshold = threshold
        self.gear_names = ("base", "shift")

    def choose_gear(self, num_tokens: int) -> int:
        return BASE if num_tokens > self.threshold else SHIFT

    def pad_multiple(self, gear: int) -> int:
        # Only the base gear splits tokens over SP ranks (§3.2: pad to a multiple of SP).
        return self.sp if gear == BASE else 1

    def layout(self) -> dict[str, int]:
        return {"sp": self.sp, "tp": self.tp}

    def live_parameters(self) -> dict[str, LiveValue]:
        return {"threshold": self.threshold}

    def _check_live(self, name: str, value: LiveValue) -> None:
        if name == "threshold" and (
            not isinstance(value, int) or isinstance(value, bool) or value < 0
        ):
            raise InvalidRequestError(
                "shift.threshold", f"shift.threshold must be an integer >= 0, got {value!r}"
            )
