"""`spec.policy.auto.traffic.source: Observed` without a cluster (issue 30, item 4): the router's
window becomes the plan's traffic, quantised so noise does not replan, below the minimum the
declared traffic is planned from, an unreachable router keeps the last plan's figures, and a
plan from observed traffic goes through the same cooldown as any other."""

from __future__ import annotations

import copy
import datetime as dt
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from gearshift.operator.reconcile import auto, auto_traffic
from gearshift.operator.reconcile.reconciler import runnable
from gearshift.operator.reconcile.spec import SpecError, parse
from gearshift.operator.router.traffic_window import TrafficSummary, estimate
from gearshift.operator.sim import auto_policy
from gearshift.operator.sim.arrivals import Arrivals, RateCurve
from gearshift.operator.sim.lengths import LogNormal
from gearshift.v1 import router_pb2

REPO = Path(__file__).resolve().parents[2]
NOW = dt.datetime(2026, 11, 24, tzinfo=dt.UTC)
CHAT = {"rate": 0.05, "prompt": {"fixed": 64}, "output": {"fixed": 200}}


def _body(**fields: Any) -> dict[str, Any]:
    body = yaml.safe_load((REPO / "docs/examples/auto.yaml").read_text())
    body["metadata"].update(namespace="ns", uid="u", generation=1)
    a = body["spec"]["policy"]["auto"]
    a.pop("goodput")
    traffic = {**copy.deepcopy(CHAT), "source": "Observed"}
    a.update(gpu="H100", requests=10, policies=["static", "shift"], traffic=traffic)
    a.update(fields)
    return body


def _status(summary: TrafficSummary) -> router_pb2.RouterStatus:
    out = router_pb2.RouterStatus(model="m")
    t = out.traffic
    t.requests, t.window_seconds = summary.requests, summary.window_s
    t.rate, t.burstiness = summary.rate, summary.burstiness
    for side, lengths in ((t.prompt_tokens, summary.prompt), (t.output_tokens, summary.output)):
        side.median, side.p90, side.min, side.max = (
            lengths.median,
            lengths.p90,
            lengths.low,
            lengths.high,
        )
    return out


def _seen(rate: float, cv: float, prompt: int, output: int, n: int = 400, seed: int = 0) -> Any:
    """What the router's window reports for ``n`` seeded arrivals (the real estimator)."""
    times = Arrivals(RateCurve.constant(rate), cv).times(n, np.random.default_rng(seed))
    return _status(estimate(times, [prompt] * n, [output] * n))


def test_observed_figures_are_quantised_and_kept_within_the_hysteresis() -> None:
    seen = _seen(20.0, 2.0, 8000, 16)
    first = auto_traffic.choose(seen, "", {})
    f = first.figures
    assert f is not None and first.status["source"] == "Observed"
    assert f["rate"] == float(f"{seen.traffic.rate:.2g}")  # 2 significant figures
    assert f["burstiness"] == float(f"{seen.traffic.burstiness:.2g}")
    assert f["prompt"] == {"fixed": 8000} and f["output"] == {"fixed": 16}
    before = {"policy": {"static": {"tp": 8}}, "traffic": first.status}
    # Within 10% of the last plan's figures: the same figures, so the same digest.
    near = copy.deepcopy(seen)
    near.traffic.rate *= 1.08
    near.traffic.burstiness *= 0.93
    assert auto_traffic.choose(near, "", before).figures == f
    spec = parse(_body())
    key = auto.digest(spec, "H100", None, first)
    assert auto.digest(spec, "H100", None, auto_traffic.choose(near, "", before)) == key
    # A real change replans.
    far = copy.deepcopy(seen)
    far.traffic.rate *= 1.5
    moved = auto_traffic.choose(far, "", before)
    assert moved.figures is not None and moved.figures["rate"] == float(f"{far.traffic.rate:.2g}")
    assert auto.digest(spec, "H100", None, moved) != key


def test_observed_lengths_rebuild_a_lognormal_with_their_median_and_p90() -> None:
    rng = np.random.default_rng(5)
    drawn = LogNormal.from_median_p90(300, 900, 1, 4096)
    prompts, outputs = drawn.sample(2000, rng), drawn.sample(2000, rng)
    times = Arrivals(RateCurve.constant(4.0), 1.0).times(2000, rng)
    figures = auto_traffic.choose(_status(estimate(times, prompts, outputs)), "", {}).figures
    assert figures is not None
    shape = auto_policy.GroupShape(8, 8, 2)
    traffic = auto_policy.traffic_of(parse(_body()).policy.auto, shape, figures)
    assert traffic.rate == pytest.approx(figures["rate"] / 2)  # each of 2 groups' share
    rebuilt = traffic.prompt.sample(20000, np.random.default_rng(1))
    assert float(np.median(rebuilt)) == pytest.approx(300, rel=0.1)
    assert float(np.percentile(rebuilt, 90)) == pytest.approx(900, rel=0.1)


def test_too_few_requests_plan_from_the_declared_traffic_and_say_so() -> None:
    few = _seen(20.0, 1.0, 8000, 16, n=auto_traffic.MIN_REQUESTS - 1)
    chosen = auto_traffic.choose(few, "", {})
    assert chosen.figures is None and chosen.status["source"] == "Declared"
    assert f"fewer than {auto_traffic.MIN_REQUESTS}" in chosen.status["message"]
    _, resolved = runnable(_body(), {}, None, NOW, router=few)
    assert resolved is not None
    assert resolved.status["predicted"]["rate"] == pytest.approx(CHAT["rate"])
    assert resolved.status["traffic"]["source"] == "Declared"


def test_an_unreachable_router_keeps_the_last_plans_figures() -> None:
    seen = _seen(20.0, 1.0, 8000, 16)
    first = auto_traffic.choose(seen, "", {})
    before = {"policy": {"static": {"tp": 8}}, "traffic": first.status}
    lost = auto_traffic.choose(None, "UNAVAILABLE", before)
    assert lost.figures == first.figures and "UNAVAILABLE" in lost.observing
    spec = parse(_body())
    assert auto.digest(spec, "H100", None, lost) == auto.digest(spec, "H100", None, first)
    # With no observed plan yet: the declared traffic.
    assert auto_traffic.choose(None, "UNAVAILABLE", {}).figures is None


def test_a_plan_from_observed_traffic_is_held_by_the_cooldown_like_any_other() -> None:
    # margin 0: the predicted gain of Shift over TP 8 here is a few percent on the scaled preset.
    body = _body(margin=0)
    _, first = runnable(body, {}, None, NOW, router=_seen(20.0, 1.0, 8000, 16, n=10))
    assert first is not None and first.status["choice"] == "tp8", first.status
    later = NOW + dt.timedelta(minutes=1)
    busy = _seen(20.0, 1.0, 8000, 16)
    spec, held = runnable(body, {"auto": first.status}, None, later, router=busy)
    assert held is not None and spec.policy.static.tp == 8  # the running layout stays
    rec = held.status["recommendation"]
    assert rec["choice"] in ("sp8", "shift8") and "cooldown until" in rec["held"], rec
    assert rec["traffic"]["source"] == "Observed"
    assert rec["predicted"]["rate"] == pytest.approx(rec["traffic"]["figures"]["rate"])
    # The next pass sees slightly different figures: no new plan, nothing changes.
    jitter = copy.deepcopy(busy)
    jitter.traffic.rate *= 1.05
    _, again = runnable(body, {"auto": held.status}, None, later, router=jitter)
    assert again is not None and not again.planned and again.status == held.status
    # Without a cooldown the same observed plan is applied.
    body = _body(margin=0, cooldownSeconds=0)
    spec, applied = runnable(body, {"auto": first.status}, None, later, router=busy)
    assert applied is not None and applied.status["choice"] in ("sp8", "shift8")
    assert applied.status["traffic"]["figures"]["rate"] == pytest.approx(20.0, rel=0.15)


def test_a_bad_source_is_refused_naming_the_field() -> None:
    body = _body()
    body["spec"]["policy"]["auto"]["traffic"]["source"] = "Measured"
    with pytest.raises(SpecError) as err:
        parse(body)
    assert err.value.field == "spec.policy.auto.traffic.source"
    assert str(err.value).startswith("spec.policy.auto.traffic.source: ")
