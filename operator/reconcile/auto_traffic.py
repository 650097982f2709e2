"""``spec.policy.auto.traffic.source: Observed`` (issue 30, item 4): the traffic a plan is made
from, read from the router's window (Admin.GetStatus ``traffic``, operator/router/traffic_window.py)
instead of the declared fields.

The figures go into the plan's inputs digest, so a change replans; raw estimates move with every
request, so they are quantised first: each figure (whole-deployment rate, burstiness, each
length's median, p90, low and high) keeps the value the last plan used while the new estimate is
within ``HYSTERESIS`` (10%) of it, and is otherwise rounded to 2 significant figures. Jitter around
a rounding boundary then replans nothing; a real change of more than 10% replans, and the new plan
is applied only through ``auto_apply``'s margin and cooldown like any other.

Below ``MIN_REQUESTS`` finished requests in the window the declared traffic is planned from, and
the plan's ``status.auto.traffic`` says so. A router that cannot be reached changes nothing: the
figures of the last plan are planned from again (the declared ones if it had none), so the digest,
and the running choice, stay; ``status.auto.observing`` carries the router's error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gearshift.v1 import policy_pb2, router_pb2

FIELD = "spec.policy.auto.traffic.source"
OBSERVED = policy_pb2.AutoTraffic.Source.Observed
# Fewer finished requests than this say little about burstiness or the p90 of a length.
MIN_REQUESTS = 100
# A figure within this fraction of the last plan's keeps the last plan's value.
HYSTERESIS = 0.1


@dataclass(frozen=True)
class PlanTraffic:
    """What a plan's traffic is: ``figures`` (None: the declared fields) and how it came."""

    figures: dict[str, Any] | None  # {rate, burstiness, prompt, output}: sim/traffic's mapping
    status: dict[str, Any]  # the plan's status.auto.traffic
    observing: str = ""  # why the router was not read this pass ("" when it was)


def observes(auto: policy_pb2.AutoPolicy) -> bool:
    return auto.HasField("traffic") and auto.traffic.source == OBSERVED


def last_figures(before: dict[str, Any]) -> dict[str, Any] | None:
    """The observed figures of the latest plan in status.auto (a held recommendation's, else
    the running one's); None when it used the declared traffic."""
    for plan in (before.get("recommendation") or {}, before):
        traffic = plan.get("traffic")
        if isinstance(traffic, dict):
            figures = traffic.get("figures")
            return dict(figures) if isinstance(figures, dict) else None
    return None


def choose(
    router: router_pb2.RouterStatus | None, router_error: str, before: dict[str, Any]
) -> PlanTraffic:
    """The traffic to plan from, given the router's status (None: not reached, why in
    ``router_error``) and the last status.auto (``before``)."""
    last = last_figures(before)
    if router is None:
        why = f"the router cannot be reached ({router_error}): the last plan's traffic is kept"
        return _of(last, "the router could not be read", why)
    seen = router.traffic
    if seen.requests < MIN_REQUESTS or seen.window_seconds <= 0 or seen.rate <= 0:
        note = (
            f"the router's window holds {seen.requests} finished requests, fewer than "
            f"{MIN_REQUESTS}: planned from the declared traffic"
        )
        return PlanTraffic(None, {"source": "Declared", "message": note})
    figures = quantise(seen, last)
    status = {
        "source": "Observed",
        "figures": figures,
        "requests": int(seen.requests),
        "windowSeconds": round(seen.window_seconds, 3),
        "message": (
            f"observed over {seen.requests} requests in {seen.window_seconds:.0f} s "
            f"(rounded to 2 significant figures, kept within {HYSTERESIS:.0%} of the last plan's)"
        ),
    }
    return PlanTraffic(figures, status)


def _of(last: dict[str, Any] | None, message: str, observing: str) -> PlanTraffic:
    if last is None:
        return PlanTraffic(
            None, {"source": "Declared", "message": f"{message}: planned from the declared traffic"}
        )
    note = f"{message}: planned from the last observed traffic"
    return PlanTraffic(last, {"source": "Observed", "figures": last, "message": note}, observing)


def quantise(seen: router_pb2.ObservedTraffic, last: dict[str, Any] | None) -> dict[str, Any]:
    """The figures a plan uses for ``seen``: the last plan's within HYSTERESIS, else 2 s.f."""
    last = last or {}
    return {
        "rate": _figure(seen.rate, last.get("rate")),
        # A perfectly even stream has CV 0, which no Gamma process has: floor it.
        "burstiness": max(0.1, _figure(seen.burstiness, last.get("burstiness"))),
        "prompt": _lengths(seen.prompt_tokens, last.get("prompt")),
        "output": _lengths(seen.output_tokens, last.get("output")),
    }


def _figure(raw: float, last: Any) -> float:
    if isinstance(last, int | float) and last > 0 and abs(raw / last - 1) <= HYSTERESIS:
        return float(last)
    return float(f"{raw:.2g}")


def _lengths(seen: router_pb2.LengthSummary, last: Any) -> dict[str, Any]:
    """A lognormal from the median and p90 (sim/traffic's mapping), or a fixed length when
    they coincide once rounded."""
    before = (last or {}).get("lognormal") if isinstance(last, dict) else None
    before = before if isinstance(before, dict) else {}
    if isinstance(last, dict) and "fixed" in last:
        before = {"median": last["fixed"], "p90": last["fixed"]}
    median = max(1.0, _figure(seen.median, before.get("median")))
    p90 = _figure(seen.p90, before.get("p90"))
    if p90 <= median:
        return {"fixed": round(median)}
    low = max(1, int(_figure(seen.min, before.get("low"))))
    high = max(low + 1, round(p90) + 1, int(_figure(seen.max, before.get("high"))))
    return {"lognormal": {"median": median, "p90": p90, "low": low, "high": high}}
