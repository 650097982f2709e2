"""``gearshift plan`` without the simulations that cannot change its recommendation (issue 30,
item 5). Each candidate first gets its no-queueing lower bounds (``bounds.py``: a few steps a
request); then, in the order of its lower-bound p99 TTFT (likely winners first):

- with an SLO, a candidate whose lower bounds already miss it is pruned: it meets it at no rate;
- a candidate whose lower-bound p99 TTFT cannot even tie (``error_band``) the best simulated so
  far is pruned when TTFT is what decides: without an SLO, or once the best so far meets the SLO
  at the sweep's top rate (so no candidate can beat it on goodput, only tie);
- of the rates: without an SLO only the declared rate decides (and is all the table shows); with
  one, the declared rate and then the others from the top down until one meets the SLO (the
  highest rate meeting it is then known).

If in the end no simulated candidate meets the SLO at the declared rate, the recommendation falls
back to the lowest p99 TTFT over all, so the candidates pruned for the SLO run their declared
rate then, unless their bound cannot tie the best. Every candidate stays in the report, a pruned
one with the reason and its bounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gearshift.operator.sim.bounds import Bound, alone
from gearshift.operator.sim.candidates import Candidate
from gearshift.operator.sim.error_band import ErrorBand
from gearshift.operator.sim.goodput import Goodput
from gearshift.operator.sim.planning import CandidateResult, run_point
from gearshift.operator.sim.traffic import Traffic


def run_pruned(
    candidates: Sequence[Candidate],
    traffic: Traffic,
    sweep: Sequence[float],
    goodput: Goodput | None,
    band: ErrorBand,
    progress: Any = None,
) -> list[CandidateResult]:
    """Each candidate's result, simulated only where it can change the recommendation."""
    trace = traffic.trace()
    results = [CandidateResult(c, sweep_top=max(sweep)) for c in candidates]
    bounds: dict[int, Bound] = {}
    for i, res in enumerate(results):
        try:
            bounds[i] = alone(res.candidate, trace)
        except RuntimeError as exc:  # a request needs more KV than the group has, even alone
            res.error = str(exc)
            continue
        b = bounds[i]
        res.bound = {"ttft_p99_s": b.ttft_p99, "refused": b.refused}
    order = sorted(bounds, key=lambda i: bounds[i].ttft_p99)
    declared = next(r for r in sweep if r == traffic.rate)
    others = sorted((r for r in sweep if r != declared), reverse=True)
    per = 1 + (len(others) if goodput is not None else 0)
    bar = _Bar(progress, per * len(order))
    deferred: list[int] = []
    for i in order:
        res, b = results[i], bounds[i]
        if goodput is not None and not b.can_meet(goodput):
            res.pruned = f"its lower bounds (no queueing) miss the SLO ({goodput})"
            deferred.append(i)
            bar.skip(per)
            continue
        lead = _ttft_lead(results, goodput, sweep)
        # Only a bound above the lead's band: one below it may beat the lead, not just tie.
        if lead is not None and b.ttft_p99 > lead and not band.tie(b.ttft_p99, lead, "ttft_p99_s"):
            res.pruned = (
                f"its lower-bound p99 TTFT {b.ttft_p99:.4g} s cannot tie the best's {lead:.4g} s"
            )
            bar.skip(per)
            continue
        run_point(res, traffic, declared, goodput)
        bar.done(1)
        left = per - 1
        for rate in others if goodput is not None else ():
            # From the top down to the first rate that meets the SLO: the highest one is then
            # known; below the declared rate only when that did not meet it either.
            if res.error is not None or (res.at_rate_met and rate < declared):
                break
            run_point(res, traffic, rate, goodput)
            bar.done(1)
            left -= 1
            if any(p["rate"] == rate and p.get("met") for p in res.points):
                break
        bar.skip(left)
    if goodput is not None and not any(r.at_rate_met for r in results):
        # The fallback rule ranks every candidate by p99 TTFT at the declared rate.
        for i in deferred:
            res, b = results[i], bounds[i]
            lead = _ttft_lead(results, None, sweep)
            if lead is None or b.ttft_p99 <= lead or band.tie(b.ttft_p99, lead, "ttft_p99_s"):
                res.pruned = None
                bar.add(1)
                run_point(res, traffic, declared, goodput)
                bar.done(1)
    return results


def _ttft_lead(
    results: list[CandidateResult], goodput: Goodput | None, sweep: Sequence[float]
) -> float | None:
    """The p99 TTFT a candidate must tie to matter, when TTFT is what decides; else None."""
    # A candidate that refused requests cannot lead (planning.recommend ranks it after every
    # one that refused none), so its p99 TTFT prunes nothing.
    ran = [r for r in results if r.at_rate and r.at_rate.get("requests") and not r.refused_at_rate]
    if goodput is not None:
        ran = [r for r in ran if r.at_rate_met and r.max_rate == max(sweep)]
    return min((float(r.at_rate["ttft_p99_s"]) for r in ran), default=None)  # type: ignore[index]


class _Bar:
    """A progress bar whose total is the points still to simulate: a pruned point leaves the
    total, so the ETA counts only work that will be done."""

    def __init__(self, progress: Any, total: int) -> None:
        self.progress = progress
        if progress is not None:
            progress.total = total
            progress.refresh()

    def done(self, n: int) -> None:
        if self.progress is not None:
            self.progress.update(n)

    def add(self, n: int) -> None:
        if self.progress is not None:
            self.progress.total += n
            self.progress.refresh()

    def skip(self, n: int) -> None:
        if self.progress is not None and n > 0:
            self.progress.total -= n
            self.progress.refresh()
