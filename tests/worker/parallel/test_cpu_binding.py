"""CPU ranks that together use exactly the host's cores are pinned, one share each."""

from __future__ import annotations

import os

import pytest

from gearshift.worker.launch import GroupConfig

TP2 = {"static": {"tp": 2}}

CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []

needs_cores = pytest.mark.skipif(
    len(CORES) < 2 or len(CORES) % 2, reason="needs an even number (>= 2) of usable cores"
)


@needs_cores
def test_two_ranks_owning_the_host_get_disjoint_cores(tiny_checkpoint, group_factory):
    half = len(CORES) // 2
    engine = group_factory(
        tiny_checkpoint("llama3-scaled"),
        TP2,
        group=GroupConfig(threads_per_rank=half),
        record=False,
        skip_tokenizer_init=True,
    )
    (follower,) = engine.executor.children
    assert os.sched_getaffinity(0) == set(CORES[:half])
    assert os.sched_getaffinity(follower.pid) == set(CORES[half:])
    engine.shutdown()
    assert os.sched_getaffinity(0) == set(CORES)  # the caller's process gets its cores back


@needs_cores
@pytest.mark.parametrize(
    "group",
    [
        GroupConfig(threads_per_rank=1, cpu_bind=False),
        GroupConfig(threads_per_rank=len(CORES)),  # more threads than cores: shared
    ],
    ids=["off", "oversubscribed"],
)
def test_ranks_stay_unpinned_when_binding_is_off_or_does_not_fit(
    tiny_checkpoint, group_factory, group
):
    engine = group_factory(
        tiny_checkpoint("llama3-scaled"), TP2, group=group, record=False, skip_tokenizer_init=True
    )
    (follower,) = engine.executor.children
    assert os.sched_getaffinity(0) == set(CORES)
    assert os.sched_getaffinity(follower.pid) == set(CORES)
