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

The progress bar (``progress.py``) counts the lower bounds, then the points, whose total is the
most that can still run: a candidate's whole sweep until its turn, one fallback point per
candidate pruned for the SLO until one meets it, and none for a candidate as soon as its bound
cannot tie the best (the best only improves, so it stays pruned).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gearshift.operator.sim.bounds import Bound, alone
from gearshift.operator.sim.candidates import Candidate
from gearshift.operator.sim.error_band import ErrorBand
from gearshift.operator.sim.goodput import Goodput
from gearshift.operator.sim.planning import CandidateResult, run_point
from gearshift.operator.sim.progress import Progress
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
    bar = Progress(progress)
    bar.phase("lower bounds", len(results), "candidate")
    bounds: dict[int, Bound] = {}
    for i, res in enumerate(results):
        try:
            bounds[i] = alone(res.candidate, trace)
        except RuntimeError as exc:  # a request needs more KV than the group has, even alone
            res.error = str(exc)
        else:
            b = bounds[i]
            res.bound = {"ttft_p99_s": b.ttft_p99, "refused": b.refused}
        bar.done(1)
    order = sorted(bounds, key=lambda i: bounds[i].ttft_p99)
    declared = next(r for r in sweep if r == traffic.rate)
    others = sorted((r for r in sweep if r != declared), reverse=True)
    per = 1 + (len(others) if goodput is not None else 0)
    # Known before any simulation: who misses the SLO even alone. Each runs nothing, but one
    # point in the fallback, which stays on the total until a candidate meets the SLO.
    missing = {i for i in order if goodput is not None and not bounds[i].can_meet(goodput)}
    fallback = len(missing)
    bar.phase("simulating", per * (len(order) - len(missing)) + fallback, at_most=True)
    deferred: list[int] = []
    gone: set[int] = set()  # taken off the total ahead of their turn

    def cannot_tie(k: int, lead: float | None) -> bool:
        # Only a bound above the lead's band: one below it may beat the lead, not just tie.
        b = bounds[k].ttft_p99
        return lead is not None and b > lead and not band.tie(b, lead, "ttft_p99_s")

    def cut_ahead(rest: Sequence[int], lead: float | None, n: int) -> None:
        # The lead only falls as candidates are simulated: a bound that cannot tie it now never
        # will, so that candidate's points leave the total now, not at its turn.
        for k in rest:
            if k not in gone and k not in missing and cannot_tie(k, lead):
                gone.add(k)
                bar.drop(n)

    for pos, i in enumerate(order):
        res, b = results[i], bounds[i]
        if i in missing:
            res.pruned = f"its lower bounds (no queueing) miss the SLO ({goodput})"
            deferred.append(i)
            continue
        lead = _ttft_lead(results, goodput, sweep)
        if cannot_tie(i, lead):
            res.pruned = (
                f"its lower-bound p99 TTFT {b.ttft_p99:.4g} s cannot tie the best's {lead:.4g} s"
            )
            if i not in gone:
                bar.drop(per)
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
        bar.drop(left)
        if res.at_rate_met:  # the fallback will not run
            bar.drop(fallback)
            fallback = 0
        cut_ahead(order[pos + 1 :], _ttft_lead(results, goodput, sweep), per)
    if goodput is not None and not any(r.at_rate_met for r in results):
        # The fallback rule ranks every candidate by p99 TTFT at the declared rate.
        missing.clear()  # now each deferred one is one point, cut like the others
        for pos, i in enumerate(deferred):
            res = results[i]
            if cannot_tie(i, _ttft_lead(results, None, sweep)):
                if i not in gone:
                    bar.drop(1)
                continue
            res.pruned = None
            run_point(res, traffic, declared, goodput)
            bar.done(1)
            cut_ahead(deferred[pos + 1 :], _ttft_lead(results, None, sweep), 1)
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
