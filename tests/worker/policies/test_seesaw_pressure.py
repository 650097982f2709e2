"""Seesaw pressure test: a small device KV cache, a host store that fills several times over,
and more prompts than either holds (P2 -> T2, 2 gloo ranks, fp32).

What the issue's user saw before admission by free host pages: about 1,000 prompt tokens
prefilled as 6,663, with 77 preemptions. Here nothing may be recomputed (the engine's own
counts: prefilled tokens equal prompt tokens, no preempted token), the phases switch no more
often than the capacities force for this trace, and greedy text equals one process.
"""

from __future__ import annotations

import pytest
import torch

from gearshift.worker.policies.seesaw.leader import Phase
from gearshift.worker.sampling.params import SamplingParams
from tests.worker.policies.test_seesaw import (
    _model,
    _seesaw,
    no_leftover_segments,  # noqa: F401 - a fixture
)

P2, T2 = {"tp": 1, "pp": 2}, {"tp": 2, "pp": 1}
BLOCK = 4
PRESSURE = {
    "skip_tokenizer_init": True,
    "block_size": BLOCK,
    "max_num_batched_tokens": 32,
    "max_model_len": 128,
    "enable_prefix_caching": False,
}
# 4 layers x 2 KV heads x head_dim 8, fp32: 1 KiB per device block on each rank (either gear),
# 2 KiB per host page (every layer and head).
DEVICE_BLOCKS = 48  # 192 tokens per rank: a fifth of the trace
HOST_PAGES = 64  # 256 tokens: a quarter of the trace


def _trace(n: int = 16, seed: int = 29) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(40, 81, (n,), generator=g).tolist()
    return [torch.randint(0, 128, (length,), generator=g).tolist() for length in lengths]


def minimum_transitions(prompt_lengths: list[int], host_pages: int, block: int) -> int:
    """The fewest gear switches that a host store of ``host_pages`` pages allows for prompts
    served in arrival order: every prompt's KV goes through the store, so each prefill phase
    takes a run of consecutive prompts whose pages fit it (greedy packing of a run is optimal),
    and the phases alternate prefill, decode, ..., ending in decode."""
    phases, used = 1, 0
    for length in prompt_lengths:
        pages = -(-length // block)
        assert pages <= host_pages, "a prompt larger than the store"
        if used + pages > host_pages:
            phases, used = phases + 1, 0
        used += pages
    return 2 * phases - 1


@pytest.mark.parametrize("async_swap", [True, False], ids=["async", "sync"])
def test_seesaw_pressure_recomputes_nothing_and_switches_the_fewest_times(
    no_leftover_segments,  # noqa: F811
    tiny_checkpoint,
    group_factory,
    engine_factory,
    async_swap,
):
    folder = _model(tiny_checkpoint)
    prompts = _trace()
    lengths = [len(p) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ref = engine_factory(folder, record=False, kv_cache_bytes=64 << 20, **PRESSURE)
    want = [o.token_ids for o in ref.generate(prompts, params)]

    policy = _seesaw(P2, T2, hostKvCapacityBytes=HOST_PAGES * 2048, asyncSwap=async_swap)
    engine = group_factory(
        folder, policy, kv_cache_bytes=DEVICE_BLOCKS * 1024, record=False, **PRESSURE
    )
    assert engine.blocks.num_blocks == DEVICE_BLOCKS
    lead = engine.policy.leader
    assert lead.pages.num_pages == HOST_PAGES
    # The trace is larger than the device and than the host store: the store fills.
    assert sum(-(-n // BLOCK) for n in lengths) > 3 * HOST_PAGES > 3 * DEVICE_BLOCKS // 2
    got = [o.token_ids for o in engine.generate(prompts, params)]
    stats = engine.stats()
    assert got == want
    assert stats.num_preemptions == 0 and stats.preempted_tokens == 0
    assert stats.prompt_tokens == sum(lengths)  # every prompt token prefilled exactly once
    assert len(lead.transitions) == minimum_transitions(lengths, HOST_PAGES, BLOCK)
    assert lead.transitions[-1].to is Phase.DECODE
    assert max(t.host_usage for t in lead.transitions) > 0.8  # the store did fill
