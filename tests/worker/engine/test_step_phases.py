"""The leader's per-step host time, by phase, in the engine's stats (issue 27)."""

from __future__ import annotations

import time

import torch

from gearshift.worker.sampling.params import SamplingParams
from gearshift.worker.step_phases import PHASES, StepPhases


def test_phases_add_up_and_average_over_finished_steps() -> None:
    phases = StepPhases()
    with phases.timed("plan"):
        time.sleep(0.01)
    phases.add("plan", 0.02)
    phases.steps = 2
    assert set(phases.per_step()) == set(PHASES)
    assert 0.015 <= phases.per_step()["plan"] < 0.5
    assert StepPhases().per_step()["wait"] == 0.0  # no step yet: zeros, no division by zero


def test_an_engine_reports_where_each_steps_host_time_went(tiny_checkpoint, engine_factory):
    engine = engine_factory(tiny_checkpoint("llama2-bias"), skip_tokenizer_init=True)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (4, 9)]
    started = time.perf_counter()
    engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    elapsed = time.perf_counter() - started
    stats = engine.stats()
    assert engine.phases.steps == stats.steps > 0
    per_step = stats.step_phases
    assert set(per_step) == set(PHASES)
    for phase in ("schedule", "plan", "forward", "sample", "outputs"):
        assert per_step[phase] > 0.0, phase
    assert per_step["broadcast"] == 0.0  # one process: no plan is sent anywhere
    assert sum(per_step.values()) * stats.steps <= elapsed
