"""A seeded synthetic trace: arrivals from ``arrivals.py``, lengths from ``lengths.py``."""

from __future__ import annotations

import numpy as np

from gearshift.operator.sim.arrivals import Arrivals
from gearshift.operator.sim.lengths import Lengths
from gearshift.operator.sim.trace import TraceError, TraceRequest


def synthesize(
    count: int, arrivals: Arrivals, prompts: Lengths, outputs: Lengths, seed: int
) -> list[TraceRequest]:
    """``count`` requests; the same seed gives the same trace."""
    if count < 1:
        raise TraceError(f"count must be >= 1, got {count}")
    # Separate streams, so changing one distribution does not reshuffle the others.
    r_time, r_prompt, r_out = (np.random.default_rng([seed, k]) for k in range(3))
    times = arrivals.times(count, r_time)
    p = prompts.sample(count, r_prompt)
    o = outputs.sample(count, r_out)
    return [TraceRequest(t, a, b) for t, a, b in zip(times, p, o, strict=True)]
