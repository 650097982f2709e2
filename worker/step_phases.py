"""Where the leader's host time goes in each step: cheap per-phase accumulators.

The engine adds ``time.perf_counter`` differences under fixed phase names (schedule, plan,
broadcast, forward launch, sample, wait, outputs) and reports the totals in its stats; a benchmark
divides by ``steps``. On a GPU every phase but ``wait`` is host work the device does not wait
for, as long as it stays shorter than the device's step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

PHASES = ("schedule", "plan", "broadcast", "forward", "sample", "wait", "outputs")


@dataclass
class StepPhases:
    """Seconds spent in each phase since the engine started, and the steps they cover."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    steps: int = 0

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - start)

    def per_step(self) -> dict[str, float]:
        """Mean seconds per step of each phase (zeros before the first step)."""
        return {k: v / max(1, self.steps) for k, v in self.seconds.items()}
