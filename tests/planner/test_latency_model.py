"""Eq. (1): least-squares fit from (C, L, seconds) samples, and its inverse for Algorithm 3."""

from __future__ import annotations

import math
import random

import pytest

from gearshift.operator.planner.latency_model import LatencyModel, fit_latency_model


def test_the_fit_recovers_the_coefficients_of_exact_and_noisy_samples():
    true = LatencyModel(4, 0.05, 3e-5, 2e-10, 1.5e-10)
    grid = [(c, n) for c in (0, 4096, 16384, 65536) for n in (1024, 4096, 8192, 32768)]
    exact = fit_latency_model(4, [(c, n, true.seconds(c, n)) for c, n in grid])
    for got, want in zip(
        (exact.a, exact.b, exact.c, exact.d), (true.a, true.b, true.c, true.d), strict=True
    ):
        assert got == pytest.approx(want, rel=1e-6)
    rng = random.Random(0)
    noisy = fit_latency_model(
        4, [(c, n, true.seconds(c, n) * rng.uniform(0.98, 1.02)) for c, n in grid * 3]
    )
    for c, n in grid:
        assert noisy.seconds(c, n) == pytest.approx(true.seconds(c, n), rel=0.05)


def test_the_fit_refuses_samples_that_cannot_determine_the_model():
    with pytest.raises(ValueError, match="at least 4"):
        fit_latency_model(1, [(0, 1, 1.0)] * 3)
    with pytest.raises(ValueError, match="vary both"):
        fit_latency_model(1, [(0, n, n * 1e-3) for n in (1, 2, 3, 4, 5)])  # C never varies


@pytest.mark.parametrize(
    "model",
    [
        LatencyModel(1, 0.02, 4e-5, 4e-10, 2.5e-10),
        LatencyModel(2, 0.0, 1e-4, 0.0, 0.0),  # linear
        LatencyModel(8, 0.1, 0.0, 0.0, 1e-9),  # quadratic only
        LatencyModel(4, 0.05, 3e-5, 1e-10, -1e-12),  # a fit curving down outside its data
    ],
)
def test_max_length_is_the_largest_chunk_within_the_budget(model):
    for history in (0, 10_000, 100_000):
        for budget in (0.2, 1.0, 5.0):
            n = model.max_length(budget, history)
            assert model.seconds(history, n) == pytest.approx(budget, rel=1e-9)
            assert model.seconds(history, n * 1.001) > budget


def test_max_length_edge_cases():
    model = LatencyModel(1, 0.5, 1e-4, 0.0, 0.0)
    assert model.max_length(0.4, 0) == 0.0  # even an empty chunk overruns
    assert model.max_length(0.5, 0) == 0.0
    assert math.isinf(LatencyModel(1, 0.0, 0.0, 0.0, 0.0).max_length(1.0, 0))
