"""Simulator fidelity out of sample (issue 30, item 2): the shared helper's traces and figures,
and, against the real engine, a profile taken on the grid predicts the mean TTFT of a trace
unlike anything it saw (long prompts, short outputs, bursty Gamma arrivals) within a bound
honest for CI's shared cores (``benchmarks/sim_fidelity.py --oos`` reports the real error)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from benchmarks.fidelity_oos import (
    FIGURES,
    RequestRecord,
    Scenario,
    engine_records,
    figures,
    run,
    scenarios,
    sim_records,
)
from benchmarks.sim_fidelity import engine_config, random_llama, replay
from gearshift.operator.sim.profile import ProfileGrid, measure
from gearshift.operator.sim.replica import ReplicaConfig
from gearshift.operator.sim.simulator import Deployment, simulate
from gearshift.worker.launch import start_engine


def test_the_validation_traces_differ_in_lengths_and_arrivals() -> None:
    runs = scenarios()
    assert len(runs) == 2 * 3 * 3 and len({r.name for r in runs}) == len(runs)
    short = Scenario("short-prompt-long-output", "offline", 1).trace(200, 4.0)
    long = Scenario("long-prompt-short-output", "poisson", 1).trace(200, 4.0)
    assert all(r.arrival_s == 0 for r in short)
    assert np.median([r.prompt_tokens for r in short]) < np.median([r.output_tokens for r in short])
    assert np.median([r.prompt_tokens for r in long]) > 10 * np.median(
        [r.output_tokens for r in long]
    )
    assert max(r.prompt_tokens + r.output_tokens for r in short + long) < 1024
    gaps = {
        a: np.diff(
            [r.arrival_s for r in Scenario("short-prompt-long-output", a, 2).trace(400, 4.0)]
        )
        for a in ("poisson", "gamma")
    }
    cv = {a: float(np.std(g) / np.mean(g)) for a, g in gaps.items()}
    assert 0.8 < cv["poisson"] < 1.2 and cv["gamma"] > 1.8  # Gamma asked for CV 2.5
    with pytest.raises(ValueError, match="lengths: unknown mix 'chat'"):
        scenarios(lengths=["chat"])
    with pytest.raises(ValueError, match="arrivals: unknown process 'uniform'"):
        scenarios(arrivals=["uniform"])


def test_figures_and_the_summary_of_errors() -> None:
    records = [RequestRecord(0.0, 0.1, 1.1, 11), RequestRecord(0.5, 0.8, 1.3, 6)]
    got = figures(records)
    assert got["makespan_s"] == pytest.approx(1.3)
    assert got["output_tokens_per_s"] == pytest.approx(17 / 1.3)
    assert got["ttft_mean_s"] == pytest.approx(0.2) and got["ttft_p50_s"] == pytest.approx(0.2)
    assert got["ttft_p99_s"] == pytest.approx(0.1 + 0.99 * 0.2)
    assert got["tpot_mean_s"] == pytest.approx(0.1) and got["tpot_p99_s"] == pytest.approx(0.1)
    slower = [RequestRecord(r.arrival, r.first * 1.2, r.last * 1.2, r.tokens) for r in records]
    runs = scenarios(["long-prompt-short-output"], ["offline"], [1, 2])
    report = run(runs, 4, 1.0, lambda t: records, lambda t: slower)
    summary = report["summary"]["simulated"]["all"]
    assert set(summary) == set(FIGURES) and summary["makespan_s"]["runs"] == 2
    assert summary["makespan_s"]["worst_error"] == pytest.approx(1.2 * 1.3 / 1.3 - 1)
    assert summary["ttft_mean_s"]["under_predicted"] == 0
    assert len(report["runs"][0]["first_token_s"]["measured"]) == 2


@pytest.mark.serial
@pytest.mark.slow
def test_a_grid_profile_predicts_mean_ttft_on_an_out_of_sample_trace(tmp_path: Path) -> None:
    model = str(random_llama(tmp_path, hidden=128, layers=2))
    engine = start_engine(engine_config(model, 1), None)
    try:
        grid = ProfileGrid(
            prompt_lens=(16, 64, 200, 480),
            prefill_batches=(1, 3, 8),
            decode_batches=(1, 2, 4, 8),
            contexts=(32, 300),
            decode_steps=4,
            repeats=2,
        )
        cost = measure(engine, grid, seed=0).model({})
        trace = Scenario("long-prompt-short-output", "gamma", 1).trace(16, 6.0)
        measured = figures(engine_records(trace, *replay(engine, trace)))
        result = simulate(Deployment(1, ReplicaConfig.of_engine(engine), cost), trace)
    finally:
        engine.shutdown()
    predicted = figures(sim_records(result))
    assert len(result.requests) == len(trace) and result.rejected == []
    # 50%, as the wall-time parity test: the profile and the trace run seconds apart on two
    # cores that other jobs share, where a step's wall time moves by up to 2x between them
    # (benchmarks/README.md: 10-50% errors on a loaded machine). A quiet machine's error is the
    # benchmark's to report; this catches a model that is off by a factor (the per-row term or
    # the features read after the step, undone, leave TTFT 15-25% low, inside this bound).
    said = f"simulated {predicted}, measured {measured}"
    assert predicted["ttft_mean_s"] == pytest.approx(measured["ttft_mean_s"], rel=0.5), said
    assert predicted["makespan_s"] == pytest.approx(measured["makespan_s"], rel=0.5), said
