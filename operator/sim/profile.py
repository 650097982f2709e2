"""``gearshift profile``'s measurement: time the real engine's prefill and decode steps and fit
the step-cost model (issue 16, item 1a).

Steps are driven through ``LLMEngine.step`` (schedule, forward, sample: everything a step costs
the leader), and each step's batch is read off the engine's own scheduler as it is scheduled, so
the features are exactly those the simulator computes for the same batch. Every grid point runs
once untimed first: oneDNN builds kernels per shape, and that one-off cost is not a step's.

A pipeline (``Policy.micro_batches() > 1``) is profiled one micro-batch at a time: each timed
step is then one batch's whole trip through the stages, which is the cost the simulator spreads
over the stages when it keeps micro-batches in flight (``replica.py``). Timing ``step()`` with
several in flight would pair one batch with another's finish.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gearshift.operator.sim.cost_model import (
    StepCostModel,
    batch_features,
    chunk_features,
    decode_scale,
    fit,
)
from gearshift.worker.engine.scheduler import ScheduledBatch

if TYPE_CHECKING:
    from gearshift.worker.engine.llm_engine import LLMEngine

Sample = tuple[float, float, float]  # tokens, attended, seconds


@dataclass(frozen=True)
class ProfileGrid:
    """Which steps to time: prefills of ``prompt_lens`` × ``prefill_batches`` requests, and
    decodes of ``decode_batches`` requests at each context of ``contexts``."""

    prompt_lens: tuple[int, ...] = (16, 64, 128, 256, 512)
    prefill_batches: tuple[int, ...] = (1, 2, 4)
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    contexts: tuple[int, ...] = (32, 256, 768)
    decode_steps: int = 6
    repeats: int = 2


# Message sizes ``gearshift profile --layouts`` times each collective at (``--collective-sizes``):
# 4 KiB (a decode step's activations on a small model: the α end) to 16 MiB (a long prefill
# chunk's: the bandwidth end), four points a decade and a half apart, so that both terms of
# α + bytes/bandwidth are pinned. Five timed calls each, median (``--collective-repeats``); on this
# CPU's gloo that is about a second per layout.
COLLECTIVE_SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20)
COLLECTIVE_REPEATS = 5


@dataclass(frozen=True)
class CollectiveGrid:
    """Which message sizes (bytes) each collective of a multi-rank layout is timed at."""

    sizes: tuple[int, ...] = COLLECTIVE_SIZES
    repeats: int = COLLECTIVE_REPEATS


@dataclass
class Profile:
    """The timed samples of one run, and the model fitted to them."""

    prefill: list[Sample] = field(default_factory=list)
    decode: list[Sample] = field(default_factory=list)
    prefill_rows: list[int] = field(default_factory=list)  # per prefill sample: rows sampled

    def model(self, about: dict[str, object], per_row: bool = False) -> StepCostModel:
        """The fit; ``per_row``: with the prefill fit's per-row term ``d`` (opt-in: on a small
        grid it can trade against the attention term, which threw SiDP CaS's measured exchange
        off by 2x in its CI test; benchmarks/README.md, "Simulator fidelity out of sample")."""
        rows = self.prefill_rows if per_row else None
        prefill, decode = fit(self.prefill, rows), fit(self.decode)
        model = StepCostModel(prefill, decode, {}, decode_scale(self.decode, decode))

        def scaled(tokens: float, attended: float) -> float:
            return decode.seconds(tokens, attended) * model.decode_factor(int(tokens))

        errors = {
            "prefill_mean_abs_error": sum(
                abs(prefill.seconds(t, a, r) - s) / s
                for (t, a, s), r in zip(self.prefill, self.prefill_rows, strict=True)
            )
            / len(self.prefill),
            "decode_mean_abs_error": _mean_rel_error(self.decode, scaled),
            "decode_linear_mean_abs_error": _mean_rel_error(self.decode, decode.seconds),
            "prefill_samples": len(self.prefill),
            "decode_samples": len(self.decode),
            # The measured grid's far end (calibration.GRID_KEYS): past it a plan extrapolates.
            "prefill_max_tokens": max(t for t, _, _ in self.prefill),
            "prefill_max_attended": max(a for _, a, _ in self.prefill),
            "decode_max_tokens": max(t for t, _, _ in self.decode),
            "decode_max_attended": max(a for _, a, _ in self.decode),
        }
        return StepCostModel(model.prefill, model.decode, {**about, **errors}, model.decode_scale)


def _mean_rel_error(samples: list[Sample], predict: Callable[[float, float], float]) -> float:
    return sum(abs(predict(t, a) - s) / s for t, a, s in samples) / len(samples)


class _StepTimer:
    """Times ``engine.step()`` calls and pairs each with the batch its scheduler produced."""

    def __init__(self, engine: LLMEngine, clock: Callable[[], float]) -> None:
        self.engine = engine
        self.clock = clock
        # Each non-empty batch's (prefill?, tokens, attended, rows), read as it is scheduled:
        # once the step has run, its sequences have advanced, and a chunk read then would seem
        # to attend its own tokens twice over (the simulator prices a batch before it runs).
        self.batches: list[tuple[bool, int, float, int]] = []
        schedule = engine.scheduler.schedule

        def recording(*args: object, **kw: object) -> ScheduledBatch:
            batch = schedule(*args, **kw)  # type: ignore[arg-type]
            if not batch.is_empty:
                tokens, attended = batch_features(batch)
                rows = chunk_features(batch)[2]
                self.batches.append((bool(batch.prefills), tokens, attended, rows))
            return batch

        engine.scheduler.schedule = recording  # type: ignore[method-assign]

    def close(self) -> None:
        """Stop recording: the scheduler's own ``schedule`` is back (the engine may go on
        serving after it was profiled, and would otherwise grow ``batches`` at every step)."""
        del self.engine.scheduler.schedule

    def run(self, prompts: list[list[int]], max_tokens: int, into: Profile | None) -> None:
        """Run ``prompts`` to completion; with ``into``, file each step's sample there."""
        from gearshift.worker.sampling.params import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for i, ids in enumerate(prompts):
            self.engine.add_request(f"profile-{time.monotonic_ns()}-{i}", ids, params)
        while self.engine.has_unfinished_requests():
            self.batches.clear()
            start = self.clock()
            self.engine.step()
            seconds = self.clock() - start
            if into is None or len(self.batches) != 1:
                continue
            prefill, tokens, attended, rows = self.batches[0]
            if prefill:
                into.prefill.append((tokens, attended, seconds))
                into.prefill_rows.append(rows)
            else:
                into.decode.append((tokens, attended, seconds))


@contextlib.contextmanager
def _one_micro_batch(engine: LLMEngine) -> Iterator[None]:
    """Run ``engine``'s policy one step at a time, every ready sequence in it, while profiling
    (instance attributes shadow the policy's methods, and are removed after)."""
    policy = engine.policy
    if policy.micro_batches() <= 1:
        yield
        return
    from gearshift.worker.engine.contract import StepRequest

    policy.micro_batches = lambda: 1  # type: ignore[method-assign]
    policy.step_request = lambda queues: StepRequest()  # type: ignore[method-assign]
    try:
        yield
    finally:
        del policy.micro_batches, policy.step_request


def measure(
    engine: LLMEngine,
    grid: ProfileGrid,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
) -> Profile:
    """Time the grid's steps on ``engine`` (which must be idle). ``clock``: wall time; a
    benchmark may pass ``time.thread_time`` to price a one-rank engine in CPU time, which other
    processes on a shared machine do not move."""
    with _one_micro_batch(engine):
        timer = _StepTimer(engine, clock)
        try:
            return _measure(engine, grid, seed, timer)
        finally:
            timer.close()


def _measure(engine: LLMEngine, grid: ProfileGrid, seed: int, timer: _StepTimer) -> Profile:
    rng = random.Random(seed)
    limit = engine.max_model_len
    vocab = engine.vocab_size
    profile = Profile()

    def prompts(count: int, length: int) -> list[list[int]]:
        # Random ids: no two prompts share a prefix, so the prefix cache never shortens a step.
        return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]

    budget = engine.scheduler.config.max_num_batched_tokens
    for length in grid.prompt_lens:
        for count in grid.prefill_batches:
            if length >= limit or count * length > budget:
                continue  # would not fit one step: the sample would mix two
            for rep in range(grid.repeats + 1):
                timer.run(prompts(count, length), 1, profile if rep else None)
    for context in grid.contexts:
        for count in grid.decode_batches:
            if context + grid.decode_steps >= limit:
                continue
            for rep in range(grid.repeats + 1):
                timer.run(prompts(count, context), grid.decode_steps, profile if rep else None)
    return profile
