"""The router's observed-traffic window (issue 30, item 4): the estimator recovers the rate and
burstiness of seeded synthetic arrivals (the simulator's own Poisson and Gamma processes), the
window stays bounded, and the real router reports it through Admin.GetStatus."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from gearshift.operator.router.traffic_window import TrafficWindow, estimate, summarise_lengths
from gearshift.operator.sim.arrivals import Arrivals, RateCurve
from gearshift.operator.sim.lengths import sharegpt
from gearshift.v1 import common_pb2, router_pb2, router_pb2_grpc
from gearshift.worker.tokenizer import Tokenizer
from tests.router.fake_worker import Script
from tests.router.test_router_routing import Setup, run

REQUESTS = 2000
# Over 200 seeds of 2000 arrivals the worst relative errors were: Poisson rate 6.4%, CV 9.5%;
# Gamma CV 2 rate 13.4%, CV 15.7% (a heavy-tailed gap distribution converges slowly). The bounds
# sit just above those, and the five seeds below are checked.
TOLERANCE = {1.0: (0.07, 0.10), 2.0: (0.15, 0.17)}


def _draw(rate: float, cv: float, seed: int) -> list[float]:
    return Arrivals(RateCurve.constant(rate), cv).times(REQUESTS, np.random.default_rng(seed))


@pytest.mark.parametrize("cv", [1.0, 2.0])
@pytest.mark.parametrize("seed", range(5))
def test_rate_and_burstiness_are_recovered_from_seeded_arrivals(cv: float, seed: int) -> None:
    rate = 4.0
    times = _draw(rate, cv, seed)
    shuffled = list(np.random.default_rng(seed + 100).permutation(times))  # finishing order
    s = estimate(shuffled, [1] * REQUESTS, [1] * REQUESTS)
    rate_tol, cv_tol = TOLERANCE[cv]
    assert s.requests == REQUESTS
    assert s.rate == pytest.approx(rate, rel=rate_tol)
    assert s.burstiness == pytest.approx(cv, rel=cv_tol)
    assert s.window_s == pytest.approx(max(times) - min(times))


def test_poisson_and_bursty_arrivals_are_told_apart() -> None:
    poisson = estimate(_draw(4.0, 1.0, 7), [1], [1]).burstiness
    bursty = estimate(_draw(4.0, 2.0, 7), [1], [1]).burstiness
    assert poisson < 1.2 < 1.6 < bursty


def test_lengths_summary_matches_the_drawn_distribution() -> None:
    prompt, _ = sharegpt()
    drawn = prompt.sample(REQUESTS, np.random.default_rng(3))
    s = summarise_lengths(drawn)
    assert s.median == pytest.approx(float(np.median(drawn)))
    assert s.p90 == pytest.approx(float(np.percentile(drawn, 90)))
    assert (s.low, s.high) == (min(drawn), max(drawn))
    assert s.median < s.p90


def test_too_few_requests_give_no_rate() -> None:
    assert estimate([], [], []).rate == 0.0
    one = estimate([5.0], [3], [4])
    assert (one.requests, one.rate, one.burstiness) == (1, 0.0, 0.0)
    two = estimate([5.0, 7.0], [3, 5], [4, 4])
    assert (two.rate, two.burstiness) == (0.5, 0.0)


def test_window_keeps_the_last_requests_and_drops_old_arrivals() -> None:
    now = [100.0]
    window = TrafficWindow(max_requests=5, max_age_s=10.0, clock=lambda: now[0])
    for i in range(8):
        window.record(91.0 + i, prompt_tokens=i, output_tokens=1)
    assert len(window) == 5  # the count bound
    assert window.summary().prompt.low == 3
    now[0] = 105.0  # arrivals before 95 are now too old
    s = window.summary()
    assert s.requests == 4 and s.prompt.low == 4 and s.rate == pytest.approx(1.0)
    # A request finishing late with an old arrival is not counted.
    window.record(80.0, prompt_tokens=99, output_tokens=1)
    assert window.summary().prompt.high == 7
    with pytest.raises(ValueError, match="max_requests"):
        TrafficWindow(max_requests=2)


def test_admin_status_reports_the_traffic_the_router_finished(tokenizer: Tokenizer) -> None:
    async def scenario(s: Setup) -> None:
        for w in s.workers:
            w.script = Script(tokens=[5, 6, 7], finish=common_pb2.FINISH_REASON_STOP)
        for prompt in ([1, 2], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6]):
            r = await s.http.post("/v1/completions", json={"prompt": prompt})
            assert r.is_success
        async with grpc.aio.insecure_channel(s.admin_address) as channel:
            admin = router_pb2_grpc.AdminStub(channel)
            status = await admin.GetStatus(router_pb2.GetStatusRequest(), timeout=5)
        t = status.traffic
        assert t.requests == 3 and t.window_seconds > 0
        assert t.rate == pytest.approx(2 / t.window_seconds)
        assert (t.prompt_tokens.median, t.prompt_tokens.min, t.prompt_tokens.max) == (4, 2, 6)
        assert (t.output_tokens.median, t.output_tokens.p90) == (3, 3)
        assert t.max_requests > 0 and t.max_age_seconds > 0

    run(tokenizer, scenario)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    from gearshift.operator.router.server import load_tokenizer

    return load_tokenizer("smollm2")
