"""``gearshift plan``'s core (issue 16, item 3): simulate every candidate deployment at a sweep of
request rates around the declared traffic, and recommend one.

Per candidate and rate the simulator runs the declared traffic's seeded trace (same lengths at
every rate, only the arrivals scale). Reported per candidate: TTFT and TPOT p50/p99 and output
throughput at the declared rate, KV capacity, and the highest simulated rate whose run meets the
SLO (``goodput.py``: at least 90% of requests within every bound, none refused).

The recommendation: with an SLO, the candidate with the highest such rate, then the lower p99
TTFT at the declared rate; when no candidate meets the SLO at the declared rate, or no SLO is
given, the lowest p99 TTFT at the declared rate among the candidates that refused no request
there (when every one refused some, those that refused the fewest): a refusal is a request the
candidate can never serve (beyond its context, or more KV than a Tetris decode instance holds:
the router answers 400; one that only has to wait for room waits, its TTFT counting the wait, up
to the router's queue timeout), and a candidate's percentiles cover only what it served.
Candidates within the simulator's measured error of the leader (``error_band.py``) are a tie,
broken by ``TIE_RULE`` (issue 30, item 3): fewer GPUs, then the lower p99 TPOT (any
difference), then the ranking's order. ``reason`` says which rule decided, and of a tie which
step broke it (also ``tie_decision`` in the JSON).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gearshift.operator.sim.candidates import Candidate, PlanSettings, enumerate_candidates
from gearshift.operator.sim.error_band import MEASURED, ErrorBand
from gearshift.operator.sim.goodput import Goodput
from gearshift.operator.sim.hardware import Hardware
from gearshift.operator.sim.model_desc import ModelDesc
from gearshift.operator.sim.pricing import Pricing
from gearshift.operator.sim.simulator import simulate
from gearshift.operator.sim.traffic import Traffic

RATE_SWEEP = (0.25, 0.5, 1.0, 2.0, 4.0)  # multiples of the declared rate


@dataclass
class CandidateResult:
    candidate: Candidate
    points: list[dict[str, Any]] = field(default_factory=list)  # one per rate, ascending
    error: str | None = None  # why it could not be simulated
    pruned: str | None = None  # why it was not simulated (pruning.py)
    bound: dict[str, Any] | None = None  # its no-queueing lower bounds (pruning.py)
    sweep_top: float | None = None  # the sweep's highest rate (default: its last point's)

    @property
    def at_rate(self) -> dict[str, Any] | None:
        return next((p for p in self.points if p["declared"]), None)

    @property
    def at_rate_met(self) -> bool:
        at = self.at_rate
        return bool(at and at.get("met"))

    @property
    def refused_at_rate(self) -> int:
        """Requests of the declared rate's trace the candidate refused: those it can never
        serve (the router answers them 400; a request that must wait for room waits)."""
        at = self.at_rate
        return int(at.get("rejected", 0)) if at else 0

    @property
    def max_rate(self) -> float | None:
        """The highest simulated rate that met the SLO (None: none did, or no SLO)."""
        met = [p["rate"] for p in self.points if p.get("met")]
        return max(met) if met else None

    def to_json(self) -> dict[str, Any]:
        c = self.candidate
        return {
            "name": c.name,
            "policy": c.policy,
            "gpus_per_group": c.gpus_per_group,
            "replicas": c.replicas,
            "kv_tokens_per_group": c.kv_tokens,
            "max_rate_meeting_slo": self.max_rate,
            # Met at the sweep's highest rate: the true maximum lies above (widen the rates).
            "max_rate_at_sweep_top": bool(self.points)
            and self.max_rate == (self.sweep_top or self.points[-1]["rate"]),
            "gpus": c.gpus,
            "points": self.points,
            "error": self.error,
            "pruned": self.pruned,
            "lower_bound": self.bound,
        }


@dataclass
class PlanReport:
    results: list[CandidateResult]
    recommended: CandidateResult | None
    reason: str
    rates: list[float]
    traffic: Traffic
    goodput: Goodput | None
    ties: list[CandidateResult] = field(default_factory=list)  # the recommended first
    band: ErrorBand = MEASURED
    pricing: Pricing | None = None
    tie_decision: str | None = None  # how the tie was broken (``Recommendation.decision``)

    def to_json(self) -> dict[str, Any]:
        best = self.recommended
        candidates = [r.to_json() for r in self.results]
        for c in candidates:  # each simulated figure with its error band
            for point in c["points"]:
                point["error_band"] = self.band.bands(point)
            # The highest rate meeting the SLO is compared within the throughput's band
            # (``recommend``): the same interval here.
            top = c["max_rate_meeting_slo"]
            c["max_rate_error_band"] = (
                None if top is None else list(self.band.interval(top, "output_tokens_per_s"))
            )
        return {
            "rates": self.rates,
            "declared_rate": self.traffic.rate,
            "traffic": self.traffic.about,
            "goodput": str(self.goodput) if self.goodput else None,
            "candidates": candidates,
            "error_band": dataclasses.asdict(self.band),
            "ties": [r.candidate.name for r in self.ties] if len(self.ties) > 1 else [],
            "tie_rule": TIE_RULE,
            "tie_decision": self.tie_decision if len(self.ties) > 1 else None,
            "pruned_candidates": sum(r.pruned is not None for r in self.results),
            "simulated_points": sum(len(r.points) for r in self.results),
            "recommended": None if best is None else best.candidate.name,
            "recommended_policy": None if best is None else best.candidate.policy,
            "reason": self.reason,
            **(self.pricing.to_json() if self.pricing else {}),
        }


def simulate_point(
    candidate: Candidate, traffic: Traffic, rate: float, goodput: Goodput | None
) -> dict[str, Any]:
    deployment = candidate.deployment()
    trace = traffic.trace(rate)
    result = candidate.run(trace) if candidate.run is not None else simulate(deployment, trace)
    lost = len(trace) - len(result.requests) - len(result.rejected)
    if lost:  # a simulated engine that never ended some requests: say so, rank nothing on it
        raise RuntimeError(f"{lost} of {len(trace)} requests neither finished nor were refused")
    point: dict[str, Any] = {"rate": rate, "declared": math.isclose(rate, traffic.rate)}
    point.update(result.summary() if result.requests else {"requests": 0})
    point["rejected"] = len(result.rejected)
    if goodput is not None:
        point["good_share"] = goodput.good_share(result)
        point["met"] = goodput.met(result)
    return point


def plan_deployment(
    model: ModelDesc,
    hardware: Hardware,
    traffic: Traffic,
    goodput: Goodput | None = None,
    *,
    rates: Sequence[float] | None = None,
    settings: PlanSettings | None = None,
    kinds: set[str] | None = None,
    only: Callable[[Candidate], bool] | None = None,
    progress: Any = None,
    prune: bool = False,
    band: ErrorBand = MEASURED,
    pricing: Pricing | None = None,
) -> PlanReport:
    """Simulate every candidate (those ``only`` keeps, when given) at every rate; ``progress``
    (e.g. a tqdm bar; ``progress.py``) shows each phase in turn, updated once per unit of work,
    its ``total`` the work left as far as it is known. ``prune``: skip what cannot change the
    recommendation (``pruning.py``). ``pricing``: what replaces the candidates' step costs (a
    profile; ``pricing.py``), reported with them."""
    settings = settings or PlanSettings()
    sweep = sorted({*(rates or [traffic.rate * m for m in RATE_SWEEP]), traffic.rate})
    candidates = [
        c.for_traffic(c, traffic, sweep) if c.for_traffic is not None else c
        for c in enumerate_candidates(model, hardware, settings, kinds)
        if only is None or only(c)
    ]
    if pricing is not None:
        candidates = pricing.apply(candidates)
    if not candidates and pricing is not None and pricing.profile is not None:
        raise ValueError(
            f"--profile: it covers none of the candidates ({', '.join(pricing.excluded)}); "
            f"its layouts: {', '.join(pricing.profile.layouts)}"
        )
    if not candidates:
        raise ValueError(
            f"no layout of {model.name} fits {hardware.count}x{hardware.device.name} "
            f"(weights and a {settings.max_model_len}-token context per group)"
        )
    if prune:
        from gearshift.operator.sim.pruning import run_pruned

        results = run_pruned(candidates, traffic, sweep, goodput, band, progress)
    else:
        from gearshift.operator.sim.progress import Progress

        bar = Progress(progress)
        bar.phase("simulating", len(candidates) * len(sweep))
        results = []
        for candidate in candidates:
            res = CandidateResult(candidate)
            for rate in sweep:
                run_point(res, traffic, rate, goodput)
                bar.done(1)
            results.append(res)
    rec = decide(results, goodput, band)
    return PlanReport(
        results, rec.best, rec.why, sweep, traffic, goodput, rec.ties, band, pricing, rec.decision
    )


def run_point(res: CandidateResult, traffic: Traffic, rate: float, goodput: Goodput | None) -> None:
    """Simulate one rate point of ``res``'s candidate into it (none once it has failed)."""
    if res.error is not None:
        return
    try:
        res.points.append(simulate_point(res.candidate, traffic, rate, goodput))
        res.points.sort(key=lambda p: p["rate"])
    except RuntimeError as exc:  # a request needs more KV than the group has
        res.error = str(exc)


# How a tie is broken, word for word in the reason, the table, the JSON (``tie_rule``) and
# docs/planning.md. A lower p99 TPOT decides even within TPOT's error band (the rule);
# the decision then says that the difference is below the simulator's resolution.
TIE_RULE = (
    "fewer GPUs, then lower p99 TPOT (any difference, even within its error band), "
    "then the ranking's order"
)


@dataclass
class Recommendation:
    best: CandidateResult | None
    why: str  # which rule decided, the tie's decision included
    ties: list[CandidateResult]  # the recommended first; a lone winner is a list of one
    decision: str | None = None  # how the tie was broken (None: no tie)


def recommend(
    results: list[CandidateResult], goodput: Goodput | None, band: ErrorBand = MEASURED
) -> tuple[CandidateResult | None, str, list[CandidateResult]]:
    """The recommendation, why, and the candidates tied with it (``decide``)."""
    rec = decide(results, goodput, band)
    return rec.best, rec.why, rec.ties


def decide(
    results: list[CandidateResult], goodput: Goodput | None, band: ErrorBand = MEASURED
) -> Recommendation:
    """Goodput first: with an SLO, the highest simulated rate meeting it, then the lower p99
    TTFT at the declared rate; without one, or when none meets it at the declared rate, the
    lowest p99 TTFT. Figures within ``band`` of the leader's are a tie, broken by ``TIE_RULE``."""
    ran = [r for r in results if r.error is None and r.at_rate and r.at_rate.get("requests")]
    if not ran:
        return Recommendation(None, "no candidate could be simulated", [])

    def p99(r: CandidateResult) -> float:
        return float(r.at_rate["ttft_p99_s"])  # type: ignore[index]

    def tput(r: CandidateResult) -> float:
        return float(r.at_rate["output_tokens_per_s"])  # type: ignore[index]

    meeting = [r for r in ran if r.at_rate.get("met")] if goodput else []  # type: ignore[union-attr]
    if meeting:
        order = sorted(meeting, key=lambda r: (-(r.max_rate or 0.0), p99(r)))
        lead = order[0]
        tied = [
            r
            for r in order
            if band.tie(r.max_rate or 0.0, lead.max_rate or 0.0, "output_tokens_per_s")
            and band.tie(p99(r), p99(lead), "ttft_p99_s")
        ]
        rule = f"highest simulated rate meeting the SLO ({goodput})"
        on = (
            f"the highest rate meeting the SLO (within ±{band.of('output_tokens_per_s'):.0%}) "
            f"and p99 TTFT (within ±{band.of('ttft_p99_s'):.0%})"
        )
    else:
        # A candidate's percentiles cover only the requests it served: one that refused some
        # looks fast because it dropped load. Only those refusing the fewest (none, if any
        # refuse none) are ranked.
        fewest = min(r.refused_at_rate for r in ran)
        order = sorted(
            (r for r in ran if r.refused_at_rate == fewest), key=lambda r: (p99(r), -tput(r))
        )
        lead = order[0]
        tied = [r for r in order if band.tie(p99(r), p99(lead), "ttft_p99_s")]
        rule = (
            f"no candidate meets the SLO ({goodput}) at the declared rate; lowest p99 TTFT"
            if goodput
            else "no SLO given; lowest p99 TTFT at the declared rate"
        )
        if len(order) < len(ran):
            rule += (
                f" among those that refused no request ({len(ran) - len(order)} refused some)"
                if fewest == 0
                else f" among those that refused the fewest requests ({fewest}; every one "
                "refused some)"
            )
        on = f"p99 TTFT (within ±{band.of('ttft_p99_s'):.0%})"
    best = _break_tie(tied)
    why = _why(best, rule, p99(best))
    decision = None
    if len(tied) > 1:
        decision = _decision(best, tied, on, band)
        names = ", ".join(r.candidate.name for r in tied)
        why += f"; a tie within the simulator's measured error of the first ranked ({names}), "
        why += f"broken by {TIE_RULE}: {decision}"
    return Recommendation(best, why, [best, *(r for r in tied if r is not best)], decision)


def _tpot(r: CandidateResult) -> float:
    return float(r.at_rate["tpot_p99_s"])  # type: ignore[index]


def _name(r: CandidateResult) -> str:
    return r.candidate.name


def _break_tie(tied: list[CandidateResult]) -> CandidateResult:
    """``TIE_RULE`` over ``tied`` (in the ranking's order): the fewest GPUs, then the lowest p99
    TPOT, then the first in the ranking (``min`` keeps the first of equals)."""
    return min(tied, key=lambda r: (r.candidate.gpus, _tpot(r)))


def _decision(best: CandidateResult, tied: list[CandidateResult], on: str, band: ErrorBand) -> str:
    """Which step of ``TIE_RULE`` decided, against the first ranked (or the runner-up)."""
    lead = tied[0]
    gpus = best.candidate.gpus
    pool = [r for r in tied if r.candidate.gpus == gpus]

    def tpots(a: CandidateResult, b: CandidateResult) -> str:
        close = band.tie(_tpot(a), _tpot(b), "tpot_p99_s")
        return f"{_tpot(a):.4g} s against {_name(b)}'s {_tpot(b):.4g} s" + (
            f", within ±{band.of('tpot_p99_s'):.0%} of each other" if close else ""
        )

    if best is not lead and gpus < lead.candidate.gpus:
        text = f"{_name(best)} over {_name(lead)}: tied on {on}, fewer GPUs ({gpus} against "
        text += f"{lead.candidate.gpus})"
        rest = [r for r in pool if r is not best]
        if rest:
            runner = min(rest, key=_tpot)
            text += f", then of the {len(pool)} with {gpus} GPUs "
            text += (
                f"the first ranked at equal p99 TPOT ({_tpot(best):.4g} s, as {_name(runner)})"
                if _tpot(runner) == _tpot(best)
                else f"the lowest p99 TPOT ({tpots(best, runner)})"
            )
        return text
    if best is not lead:
        return (
            f"{_name(best)} over {_name(lead)}: tied on {on}, same GPUs ({gpus}), lower p99 TPOT "
            f"({tpots(best, lead)})"
        )
    text = f"{_name(lead)} stays first: tied on {on}"
    rest = [r for r in pool if r is not lead]
    if not rest:
        more = min(r.candidate.gpus for r in tied if r is not lead)
        return f"{text}, fewer GPUs than every other tied ({gpus} against {more} or more)"
    runner = min(rest, key=_tpot)
    if _tpot(runner) == _tpot(lead):
        return (
            f"{text}, same GPUs ({gpus}) and equal p99 TPOT ({_tpot(lead):.4g} s) as "
            f"{_name(runner)}: the ranking's order"
        )
    return f"{text}, lowest p99 TPOT of the {len(pool)} with {gpus} GPUs ({tpots(lead, runner)})"


def _why(best: CandidateResult, rule: str, p99: float) -> str:
    if best.max_rate is not None and "meeting" in rule:
        return f"{rule}: {best.max_rate:g} req/s; p99 TTFT {p99:.3f} s at the declared rate"
    return f"{rule}: {p99:.3f} s"
