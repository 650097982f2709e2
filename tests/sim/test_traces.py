"""Synthetic traces keep their promises (rate, burstiness, length statistics, seeds) and a saved
trace replays exactly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gearshift.operator.sim import lengths, trace
from gearshift.operator.sim.arrivals import Arrivals, RateCurve
from gearshift.operator.sim.lengths import Fixed, LogNormal, Uniform
from gearshift.operator.sim.trace import TraceError, TraceRequest
from gearshift.operator.sim.workload import synthesize


def _gaps(cv: float, rate: float, n: int = 40_000, seed: int = 3) -> np.ndarray:
    t = np.array(Arrivals(RateCurve.constant(rate), cv).times(n, np.random.default_rng(seed)))
    return np.diff(t)


@pytest.mark.parametrize("cv", [1.0, 0.5, 2.0, 4.0])
def test_arrivals_have_the_asked_rate_and_burstiness(cv: float) -> None:
    gaps = _gaps(cv, rate=8.0)
    assert 1 / gaps.mean() == pytest.approx(8.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.08)


def test_a_rate_curve_changes_the_arrival_rate_where_it_says() -> None:
    curve = RateCurve((0.0, 100.0, 200.0), (2.0, 20.0, 5.0))
    t = np.array(Arrivals(curve).times(4000, np.random.default_rng(0)))
    per_segment = [((t >= a) & (t < b)).sum() / (b - a) for a, b in ((0, 100), (100, 200))]
    assert per_segment[0] == pytest.approx(2.0, rel=0.25)
    assert per_segment[1] == pytest.approx(20.0, rel=0.1)
    assert np.all(np.diff(t) >= 0)


def test_a_zero_rate_segment_has_no_arrivals() -> None:
    curve = RateCurve((0.0, 10.0, 30.0), (5.0, 0.0, 5.0))
    t = np.array(Arrivals(curve).times(500, np.random.default_rng(1)))
    assert not ((t > 10.0) & (t < 30.0)).any()
    assert (t >= 30.0).any()


def test_bad_parameters_are_refused_naming_them() -> None:
    with pytest.raises(TraceError, match="cv"):
        Arrivals(RateCurve.constant(1.0), cv=0)
    with pytest.raises(TraceError, match="first start"):
        RateCurve((1.0,), (1.0,))
    with pytest.raises(TraceError, match="low <= high"):
        Uniform(5, 2)
    with pytest.raises(TraceError, match="unknown Tetris trace"):
        lengths.tetris("huge")


def test_length_distributions_stay_in_range_and_match_their_statistics() -> None:
    rng = np.random.default_rng(7)
    assert Fixed(17).sample(3, rng) == [17, 17, 17]
    u = np.array(Uniform(10, 20).sample(20_000, rng))
    assert u.min() == 10 and u.max() == 20 and u.mean() == pytest.approx(15, rel=0.01)
    ln = LogNormal.from_median_p90(400, 1200, 1, 1 << 20)
    s = np.array(ln.sample(40_000, rng))
    assert np.median(s) == pytest.approx(400, rel=0.05)
    assert np.percentile(s, 90) == pytest.approx(1200, rel=0.06)


@pytest.mark.parametrize("name", ["short", "medium", "long"])
def test_tetris_presets_match_the_papers_range_and_mean(name: str) -> None:
    low, high, mean = lengths.TETRIS[name]
    s = np.array(lengths.tetris(name).sample(40_000, np.random.default_rng(5)))
    assert low <= s.min() and s.max() <= high
    assert s.mean() == pytest.approx(mean, rel=0.03)


def test_the_same_seed_gives_the_same_trace_and_another_seed_does_not() -> None:
    arr = Arrivals(RateCurve.constant(3.0), cv=2.0)
    p, o = lengths.sharegpt()
    a = synthesize(200, arr, p, o, seed=11)
    assert a == synthesize(200, arr, p, o, seed=11)
    assert a != synthesize(200, arr, p, o, seed=12)


def test_a_saved_trace_replays_exactly(tmp_path: Path) -> None:
    p, o = lengths.arxiv_summarization()
    reqs = synthesize(50, Arrivals(RateCurve.constant(2.0)), p, o, seed=1)
    # A trace that starts at 0 (as load shifts it) round-trips unchanged.
    reqs = [
        TraceRequest(r.arrival_s - reqs[0].arrival_s, r.prompt_tokens, r.output_tokens)
        for r in reqs
    ]
    path = tmp_path / "t.jsonl"
    trace.save(reqs, path)
    assert trace.load(path) == reqs


def test_a_recorded_trace_is_sorted_and_shifted_and_bad_lines_are_named(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    path.write_text(
        '{"arrival_s": 5.0, "prompt_tokens": 3, "output_tokens": 2, "finish_reason": "stop"}\n'
        '{"arrival_s": 4.5, "prompt_tokens": 7, "output_tokens": 1, "finish_reason": "length"}\n'
    )
    assert trace.load(path) == [TraceRequest(0.0, 7, 1), TraceRequest(0.5, 3, 2)]
    path.write_text('{"arrival_s": 1.0, "prompt_tokens": 3}\n')
    with pytest.raises(TraceError, match=r"rec\.jsonl:1"):
        trace.load(path)


def test_the_simulator_package_does_not_import_torch() -> None:
    code = (
        "import sys, gearshift.operator.sim.simulator, gearshift.operator.sim.workload\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
