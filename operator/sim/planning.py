"""``gearshift plan``'s core (issue 16, item 3): simulate every candidate deployment at a sweep of
request rates around the declared traffic, and recommend one.

Per candidate and rate the simulator runs the declared traffic's seeded trace (same lengths at
every rate, only the arrivals scale). Reported per candidate: TTFT and TPOT p50/p99 and output
throughput at the declared rate, KV capacity, and the highest simulated rate whose run meets the
SLO (``goodput.py``: at least 90% of requests within every bound, none refused).

The recommendation: with an SLO, the candidate with the highest such rate (ties: the lower p99
TTFT at the declared rate); when no candidate meets the SLO at the declared rate, or no SLO is
given, the lowest p99 TTFT at the declared rate (ties: higher throughput). ``reason`` says which
rule decided.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gearshift.operator.sim.candidates import Candidate, PlanSettings, enumerate_candidates
from gearshift.operator.sim.goodput import Goodput
from gearshift.operator.sim.hardware import Hardware
from gearshift.operator.sim.model_desc import ModelDesc
from gearshift.operator.sim.simulator import Deployment, simulate
from gearshift.operator.sim.traffic import Traffic

RATE_SWEEP = (0.25, 0.5, 1.0, 2.0, 4.0)  # multiples of the declared rate


@dataclass
class CandidateResult:
    candidate: Candidate
    points: list[dict[str, Any]] = field(default_factory=list)  # one per rate, ascending
    error: str | None = None  # why it could not be simulated

    @property
    def at_rate(self) -> dict[str, Any] | None:
        return next((p for p in self.points if p["declared"]), None)

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
            "max_rate_at_sweep_top": bool(self.points) and self.max_rate == self.points[-1]["rate"],
            "points": self.points,
            "error": self.error,
        }


@dataclass
class PlanReport:
    results: list[CandidateResult]
    recommended: CandidateResult | None
    reason: str
    rates: list[float]
    traffic: Traffic
    goodput: Goodput | None

    def to_json(self) -> dict[str, Any]:
        best = self.recommended
        return {
            "rates": self.rates,
            "declared_rate": self.traffic.rate,
            "traffic": self.traffic.about,
            "goodput": str(self.goodput) if self.goodput else None,
            "candidates": [r.to_json() for r in self.results],
            "recommended": None if best is None else best.candidate.name,
            "recommended_policy": None if best is None else best.candidate.policy,
            "reason": self.reason,
        }


def simulate_point(
    candidate: Candidate, traffic: Traffic, rate: float, goodput: Goodput | None
) -> dict[str, Any]:
    deployment = Deployment(
        candidate.replicas,
        candidate.config,
        candidate.cost,
        candidate.step_request,
        micro_batches=candidate.micro_batches,
        stages=candidate.stages,
        stage_shares=candidate.stage_shares,
        hooks=candidate.hooks,
    )
    trace = traffic.trace(rate)
    result = candidate.run(trace) if candidate.run is not None else simulate(deployment, trace)
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
) -> PlanReport:
    """Simulate every candidate (those ``only`` keeps, when given) at every rate; ``progress``
    (e.g. a tqdm bar) is updated once per simulated point and its ``total`` set first."""
    settings = settings or PlanSettings()
    sweep = sorted({*(rates or [traffic.rate * m for m in RATE_SWEEP]), traffic.rate})
    candidates = [
        c.for_traffic(c, traffic, sweep) if c.for_traffic is not None else c
        for c in enumerate_candidates(model, hardware, settings, kinds)
        if only is None or only(c)
    ]
    if not candidates:
        raise ValueError(
            f"no layout of {model.name} fits {hardware.count}x{hardware.device.name} "
            f"(weights and a {settings.max_model_len}-token context per group)"
        )
    if progress is not None:
        progress.total = len(candidates) * len(sweep)
    results = []
    for candidate in candidates:
        res = CandidateResult(candidate)
        for rate in sweep:
            if res.error is None:
                try:
                    res.points.append(simulate_point(candidate, traffic, rate, goodput))
                except RuntimeError as exc:  # a request needs more KV than the group has
                    res.error = str(exc)
            if progress is not None:
                progress.update(1)
        results.append(res)
    best, reason = recommend(results, goodput)
    return PlanReport(results, best, reason, sweep, traffic, goodput)


def recommend(
    results: list[CandidateResult], goodput: Goodput | None
) -> tuple[CandidateResult | None, str]:
    ran = [r for r in results if r.error is None and r.at_rate and r.at_rate.get("requests")]
    if not ran:
        return None, "no candidate could be simulated"

    def p99(r: CandidateResult) -> float:
        return float(r.at_rate["ttft_p99_s"])  # type: ignore[index]

    def tput(r: CandidateResult) -> float:
        return float(r.at_rate["output_tokens_per_s"])  # type: ignore[index]

    if goodput is not None:
        meeting = [r for r in ran if r.at_rate.get("met")]  # type: ignore[union-attr]
        if meeting:
            best = max(meeting, key=lambda r: (r.max_rate or 0.0, -p99(r)))
            return best, (
                f"highest simulated rate meeting the SLO ({goodput}): {best.max_rate:g} req/s; "
                f"p99 TTFT {p99(best):.3f} s at the declared rate"
            )
        best = min(ran, key=lambda r: (p99(r), -tput(r)))
        return best, (
            f"no candidate meets the SLO ({goodput}) at the declared rate; lowest p99 TTFT: "
            f"{p99(best):.3f} s"
        )
    best = min(ran, key=lambda r: (p99(r), -tput(r)))
    return best, f"no SLO given; lowest p99 TTFT at the declared rate: {p99(best):.3f} s"
