"""Lower bounds on a candidate's figures without queueing (issue 30, item 5): each request of the
trace run alone on an idle group, by the candidate's own simulation and cost model.

Alone, a request's prompt takes the fewest steps the token budget allows, and each step holds
nothing but its own tokens; under load it shares steps (a step's cost never falls when tokens
are added to it: the roofline's FLOPs, bytes and collectives all grow with them) and waits in
the queue. So its TTFT alone bounds its TTFT under load from below, its first decode step alone
(the shortest context it decodes at) bounds every later one, hence its TPOT, and E2E is at
least TTFT + (output − 1) × that step. A percentile of per-request lower bounds bounds the same
percentile from below. Only prompts and one decode step are simulated: a few steps a request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gearshift.operator.sim.candidates import Candidate
from gearshift.operator.sim.goodput import Goodput
from gearshift.operator.sim.results import SimResult
from gearshift.operator.sim.simulator import simulate
from gearshift.operator.sim.trace import TraceRequest

GAP_S = 1000.0  # between the requests of the alone run, grown until none overlaps the next


@dataclass(frozen=True)
class Bound:
    """Per request (trace order, refused ones left out): TTFT, TPOT (None: one output token)
    and E2E lower bounds; ``refused`` requests the candidate refuses even alone."""

    ttft: tuple[float, ...]
    tpot: tuple[float | None, ...]
    e2e: tuple[float, ...]
    refused: int

    @property
    def ttft_p99(self) -> float:
        return float(np.percentile(self.ttft, 99)) if self.ttft else 0.0

    def can_meet(self, goodput: Goodput) -> bool:
        """False when even without queueing too few requests are within every bound."""
        if self.refused:
            return False
        good = sum(
            (goodput.ttft is None or t <= goodput.ttft)
            and (goodput.tpot is None or p is None or p <= goodput.tpot)
            and (goodput.e2el is None or e <= goodput.e2el)
            for t, p, e in zip(self.ttft, self.tpot, self.e2e, strict=True)
        )
        total = len(self.ttft) + self.refused
        return total > 0 and good / total >= goodput.share


def _run(candidate: Candidate, trace: Sequence[TraceRequest]) -> SimResult:
    if candidate.run is not None:
        return candidate.run(trace)
    # One replica: a request alone meets an idle group whichever the router picks.
    return simulate(candidate.deployment(1), trace)


def alone(candidate: Candidate, trace: Sequence[TraceRequest]) -> Bound:
    """The lower bounds of ``trace``'s requests on ``candidate`` (see the module's text)."""
    gap = GAP_S
    for _ in range(8):
        spaced = [
            TraceRequest(i * gap, r.prompt_tokens, min(r.output_tokens, 2))
            for i, r in enumerate(trace)
        ]
        result = _run(candidate, spaced)
        if all(r.finished - r.arrival < gap for r in result.requests):
            break
        gap *= 10  # a request was still running when the next arrived: not alone
    else:
        raise RuntimeError(f"{candidate.name}: a request alone takes over {gap:g} s")
    outputs = [trace[int(r.request_id[1:])].output_tokens for r in result.requests]
    ttft = tuple(r.ttft for r in result.requests)
    tpot = tuple(r.tpot for r in result.requests)
    e2e = tuple(
        t + (n - 1) * p if p is not None else t for t, p, n in zip(ttft, tpot, outputs, strict=True)
    )
    return Bound(ttft, tpot, e2e, len(result.rejected))
