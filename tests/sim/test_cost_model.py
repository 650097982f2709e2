"""The step-cost model: the fit recovers known coefficients (a per-row term too), features follow
the scheduler's batch, and a saved model loads back (a wrong file is refused naming it)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from gearshift.operator.sim.cost_model import (
    CostModelError,
    LinearFit,
    StepCostModel,
    StepOverhead,
    batch_features,
    chunk_features,
    fit,
)
from gearshift.worker.engine.scheduler import ScheduledBatch
from gearshift.worker.engine.sequence import Sequence


def test_the_fit_recovers_the_coefficients_of_noisy_samples() -> None:
    rng = random.Random(0)
    true = LinearFit(0.004, 2e-5, 3e-8)
    samples = []
    for _ in range(200):
        t, a = rng.randint(1, 2048), rng.uniform(0, 2e6)
        samples.append((t, a, true.seconds(t, a) * rng.uniform(0.98, 1.02)))
    got = fit(samples)
    assert got.a == pytest.approx(true.a, rel=0.1)
    assert got.b == pytest.approx(true.b, rel=0.05)
    assert got.c == pytest.approx(true.c, rel=0.05)
    with pytest.raises(CostModelError, match="at least 3"):
        fit(samples[:2])


def _seq(prompt: int, computed: int, rid: str = "a") -> Sequence:
    seq = Sequence(rid, [0] * prompt, None, 8)  # type: ignore[arg-type]
    seq.num_computed_tokens = computed
    return seq


def test_features_count_attended_positions_of_chunks_and_decodes() -> None:
    batch = ScheduledBatch(decodes=[_seq(10, 9)], prefills=[(_seq(100, 40, "b"), 20)])
    # Decode: 10 positions. Chunk of 20 after 40: 20·40 + (1 + … + 20) = 800 + 210.
    assert batch_features(batch) == (21, 10 + 1010)
    model = StepCostModel(LinearFit(1.0, 0.5, 0.001), LinearFit(9.0, 9.0, 9.0))
    assert model.step_time(batch) == pytest.approx(1.0 + 10.5 + 1.02)
    decode_only = ScheduledBatch(decodes=[_seq(10, 9)])
    assert model.step_time(decode_only) == pytest.approx(9 + 9 + 90)


def test_a_saved_model_loads_back_and_other_files_are_refused(tmp_path: Path) -> None:
    model = StepCostModel(LinearFit(1, 2, 3), LinearFit(4, 5, 6), {"model": "x"})
    path = tmp_path / "m.json"
    model.save(path)
    assert StepCostModel.load(path) == model
    path.write_text('{"prefill": {}}')
    with pytest.raises(CostModelError, match="gearshift profile"):
        StepCostModel.load(path)
    with pytest.raises(CostModelError, match="cannot read"):
        StepCostModel.load(tmp_path / "none.json")


def test_decode_scale_corrects_the_fit_per_batch_size_and_round_trips(tmp_path: Path) -> None:
    """A decode step whose cost is not linear in its batch (fp32 MKL on AMD: 2 rows dearer than
    4): the profile's per-batch ratio of measured to fitted seconds corrects the fit at the
    profiled sizes, interpolates between them and holds at the ends."""
    from gearshift.operator.sim.cost_model import decode_scale

    # Seconds at batch 1, 2, 4, 8 (context 10 each): 2 costs more than 4.
    truth = {1: 6.0, 2: 10.0, 4: 9.0, 8: 12.0}
    samples = [(float(b), 10.0 * b, s) for b, s in truth.items() for _ in range(3)]
    linear = fit(samples)
    scale = decode_scale(samples, linear)
    assert [b for b, _ in scale] == [1, 2, 4, 8]
    model = StepCostModel(LinearFit(1, 0, 0), linear, {}, scale)
    for b, seconds in truth.items():
        batch = ScheduledBatch(decodes=[_seq(10, 9, f"r{i}") for i in range(b)])
        assert model.step_time(batch) == pytest.approx(seconds)
        # The plain fit misses at least one size by more than 10%.
    assert max(abs(linear.seconds(b, 10.0 * b) / s - 1) for b, s in truth.items()) > 0.1
    f2, f4 = model.decode_factor(2), model.decode_factor(4)
    assert model.decode_factor(3) == pytest.approx((f2 + f4) / 2)
    assert model.decode_factor(64) == model.decode_factor(8)
    path = tmp_path / "m.json"
    model.save(path)
    assert StepCostModel.load(path) == model
    assert decode_scale(samples[:3], linear) == ()  # one batch size: nothing to correct
    with pytest.raises(CostModelError, match="decode_scale"):
        StepCostModel(linear, linear, {}, ((4, 1.0), (2, 1.0)))


def test_a_step_overhead_adds_the_measured_extra_by_sequences() -> None:
    flat = StepCostModel(LinearFit(0.010, 0.0, 0.0), LinearFit(0.010, 0.0, 0.0))

    def decodes(n: int) -> ScheduledBatch:
        return ScheduledBatch(decodes=[_seq(2, 1, f"r{i}") for i in range(n)])

    cost = StepOverhead(flat, ((1, 0.001), (4, 0.004)))
    assert cost.step_time(decodes(1)) == pytest.approx(0.011)
    assert cost.step_time(decodes(2)) == pytest.approx(0.012)  # between the points
    assert cost.step_time(decodes(8)) == pytest.approx(0.014)  # held beyond the last
    with pytest.raises(CostModelError, match="sorted"):
        StepOverhead(flat, ((4, 0.004), (1, 0.001)))


def test_a_prefill_fit_learns_a_per_row_cost_when_the_rows_vary() -> None:
    # Prefill steps of 1, 3 and 8 prompts: 0.6 ms a prompt that samples, on top of the tokens.
    true = LinearFit(0.010, 0.0002, 1e-8, 0.0006)
    rng = random.Random(2)
    samples, rows = [], []
    for count in (1, 3, 8):
        for length in (16, 40, 64):
            tokens, attended = count * length, count * length * (length + 1) / 2
            seconds = true.seconds(tokens, attended, count) * (1 + rng.uniform(-0.01, 0.01))
            samples.append((float(tokens), attended, seconds))
            rows.append(float(count))
    got = fit(samples, rows)
    assert got.d == pytest.approx(true.d, rel=0.15)
    assert got.b == pytest.approx(true.b, rel=0.15)
    # One prompt per sample: the per-row cost cannot be told from the intercept, so d is 0.
    ones = [s for s, r in zip(samples, rows, strict=True) if r == 1]
    assert fit(ones * 2, [1.0] * 6).d == 0.0
    with pytest.raises(CostModelError, match="row counts"):
        fit(samples, rows[:-1])


def test_a_prefill_step_pays_per_prompt_it_finishes_not_per_chunk() -> None:
    model = StepCostModel(LinearFit(1.0, 0.0, 0.0, 5.0), LinearFit(9.0, 9.0, 9.0))
    ends = ScheduledBatch(prefills=[(_seq(20, 0, "a"), 20), (_seq(30, 10, "b"), 20)])
    assert chunk_features(ends) == (40, 20 * 10.5 + 20 * (10 + 10.5), 2)
    assert model.step_time(ends) == pytest.approx(1.0 + 2 * 5.0)
    # A chunk that stops short of its prompt's end samples nothing.
    middle = ScheduledBatch(prefills=[(_seq(100, 0, "a"), 20)])
    assert chunk_features(middle)[2] == 0
    assert model.step_time(middle) == pytest.approx(1.0)
    # An older file (no d) loads with d = 0.
    assert LinearFit(**{"a": 1, "b": 2, "c": 3}).d == 0.0
