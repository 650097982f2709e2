"""StepThreads: long steps get the prefill thread count, short ones the process's own."""

from __future__ import annotations

import os

import pytest
import torch

from gearshift.worker.config import EngineConfig
from gearshift.worker.engine.model_runner import PREFILL_THREADS_MIN_TOKENS, StepThreads
from gearshift.worker.errors import InvalidRequestError

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
two_cores = pytest.mark.skipif(CORES < 2, reason="needs two usable cores")


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@two_cores
def test_long_steps_get_the_prefill_threads_and_short_ones_go_back(one_thread):
    threads = StepThreads(prefill=2)
    assert threads.for_step(PREFILL_THREADS_MIN_TOKENS) == 2
    assert torch.get_num_threads() == 2
    assert threads.for_step(PREFILL_THREADS_MIN_TOKENS - 1) == 1
    assert torch.get_num_threads() == 1
    assert threads.for_step(32) == 1


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity")
def test_prefill_threads_never_exceed_the_cores_a_pinned_rank_owns(one_thread):
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        assert StepThreads(prefill=8).prefill == 1
    finally:
        os.sched_setaffinity(0, before)


@pytest.mark.parametrize("field", ["num_threads", "prefill_threads"])
def test_thread_counts_must_be_positive(field):
    with pytest.raises(InvalidRequestError, match=field):
        EngineConfig(model="x", **{field: 0})


@two_cores
def test_an_engine_switches_threads_by_step_size(one_thread, tiny_checkpoint, engine_factory):
    from gearshift.worker.sampling.params import SamplingParams

    engine = engine_factory(
        tiny_checkpoint("llama3-scaled"),
        record=False,
        skip_tokenizer_init=True,
        prefill_threads=2,
    )
    threads = engine.executor.threads
    assert isinstance(threads, StepThreads) and (threads.base, threads.prefill) == (1, 2)
    threads.min_tokens = 100  # the tiny model's context is 256 tokens
    seen: list[int] = []
    original = threads.for_step

    def spy(num_tokens: int) -> int:
        seen.append(original(num_tokens))
        return seen[-1]

    threads.for_step = spy  # type: ignore[method-assign]
    prompt = [(7 * i) % 100 for i in range(120)]
    engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert seen == [2, 1, 1]  # the prefill step, then two decode steps
    assert torch.get_num_threads() == 1
