"""Seesaw's tiers and scheduler seen from the outside: the KV a sequence has after a round trip
through the host store, and when the scheduler switches phase (its event log)."""

from __future__ import annotations

import itertools

import pytest
import torch

from gearshift.worker.policies.seesaw.leader import Phase
from gearshift.worker.sampling.params import SamplingParams
from tests.worker.policies.test_seesaw import (
    DEVICE_KV,
    ENGINE,
    _model,
    _prompts,
    _seesaw,
    no_leftover_segments,  # noqa: F401 - a fixture
)

P2, T2 = {"tp": 1, "pp": 2}, {"tp": 2, "pp": 1}


def _tokens(paged: torch.Tensor, n: int) -> torch.Tensor:
    """[pages, heads, block, D] -> [heads, n, D]: the first n tokens of a sequence."""
    pages, heads, block, dim = paged.shape
    return paged.permute(1, 0, 2, 3).reshape(heads, pages * block, dim)[:, :n]


@pytest.mark.parametrize("async_swap", [True, False], ids=["async", "sync"])
def test_kv_after_swap_out_in_c_p_and_swap_in_in_c_d_equals_one_process(
    no_leftover_segments,  # noqa: F811
    tiny_checkpoint,
    group_factory,
    engine_factory,
    async_swap,
):
    folder = _model(tiny_checkpoint)
    prompt = _prompts(3)[2]  # 16 tokens: four full blocks
    n = len(prompt)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    ref = engine_factory(folder, kv_cache_bytes=64 << 20, **ENGINE)
    want = ref.generate([prompt], params)[0].token_ids
    ref_blocks = ref.executor.submitted[0].block_tables[0]
    ref_kv = ref.executor.inner.kv_caches

    policy = _seesaw(P2, T2, asyncSwap=async_swap)
    engine = group_factory(folder, policy, kv_cache_bytes=DEVICE_KV, **ENGINE)
    lead = engine.policy.leader
    engine.add_request("r", prompt, params)
    got = list(engine.step()[0].new_token_ids)  # the prefill, on the PP gear
    assert lead.phase is Phase.PREFILL
    # Swap out and re-shard (a plan without tokens), then swap in (asynchronously: plans
    # without tokens until every rank reported the copies) and the first decode.
    for _ in range(200):
        got += [t for out in engine.step() for t in out.new_token_ids]
        if len(got) == 2:
            break
    assert lead.phase is Phase.DECODE and "r" in lead.draining and len(got) == 2
    store = engine.policy.hook.store
    pages = torch.tensor(lead.pages.held["r"])
    for layer in range(4):
        for kv in (0, 1):
            host = _tokens(store.pages[pages, layer, kv], n)
            assert torch.equal(host, _tokens(ref_kv[layer][kv][ref_blocks], n)), (layer, kv)
    # The leader's decode-gear shard (TP rank 0: KV head 0 of every layer), read back in.
    runner = engine.executor.inner.runner
    blocks = torch.tensor(engine.requests["r"].blocks.block_ids)
    assert len(runner.kv_caches) == 4 and runner.kv_caches[0][0].shape[1] == 1
    for layer in range(4):
        for kv in (0, 1):
            dev = _tokens(runner.kv_caches[layer][kv][blocks], n)
            assert torch.equal(dev, _tokens(ref_kv[layer][kv][ref_blocks], n)[:1])
    # The next step's logits (the first decode, on the decode gear) equal the reference's.
    seesaw_logits = engine.executor.records[-1][1]
    ref_logits = ref.executor.records[1][1]
    torch.testing.assert_close(seesaw_logits, ref_logits, rtol=0, atol=1e-5)
    while engine.has_unfinished_requests():
        for out in engine.step():
            got += out.new_token_ids
    assert got == want


def _prefill_first_transitions(plans) -> int:
    kinds = ["prefill" if p.prefill_query_lens else "decode" for p in plans]
    return sum(a != b for a, b in itertools.pairwise(kinds))


def test_switches_only_at_its_thresholds_and_fewer_times_than_prefill_first(
    no_leftover_segments,  # noqa: F811
    tiny_checkpoint,
    group_factory,
    engine_factory,
):
    folder = _model(tiny_checkpoint)
    # 40 prompts: 155 host pages, more than the 96-page store holds (24 would fit at once).
    prompts = _prompts(40, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    # Prefill-first (the engine's own scheduler) with the same device KV per token.
    ref = engine_factory(folder, kv_cache_bytes=2 * DEVICE_KV, **ENGINE)
    want = [o.token_ids for o in ref.generate(prompts, params)]
    eager = _prefill_first_transitions(ref.executor.submitted)

    hi, lo = 0.9, 0.3
    # As in the paper, the host tier is several times the device's KV (384 vs 96 tokens).
    policy = _seesaw(
        P2,
        T2,
        hostKvCapacityBytes=96 * 2048,
        switchToDecodeAtHostUsage=hi,
        switchToPrefillAtHostUsage=lo,
    )
    engine = group_factory(folder, policy, kv_cache_bytes=DEVICE_KV, record=False, **ENGINE)
    got = [o.token_ids for o in engine.generate(prompts, params)]
    assert got == want
    log = engine.policy.leader.transitions
    assert len(log) >= 3
    for t in log:
        if t.to is Phase.DECODE:
            assert t.host_usage >= hi or t.reason in ("host store full", "no prompt waits"), t
        else:
            assert t.host_usage <= lo, t
    assert any(t.reason.startswith("host usage") and t.to is Phase.DECODE for t in log)
    assert len(log) < eager, (len(log), eager)


def test_prefix_caching_hits_within_a_prefill_phase_and_text_still_equals_one_process(
    no_leftover_segments,  # noqa: F811
    tiny_checkpoint,
    group_factory,
    engine_factory,
):
    folder = _model(tiny_checkpoint)
    shared = _prompts(3, seed=9)[2][:12]  # three full blocks every prompt starts with
    prompts = [shared + p for p in _prompts(10, seed=11)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    cached = {**ENGINE, "enable_prefix_caching": True, "max_num_batched_tokens": 24}
    ref = engine_factory(folder, record=False, kv_cache_bytes=64 << 20, **cached)
    want = [o.token_ids for o in ref.generate(prompts, params)]
    engine = group_factory(folder, _seesaw(P2, T2), kv_cache_bytes=DEVICE_KV, **cached)
    assert [o.token_ids for o in engine.generate(prompts, params)] == want
    assert engine.blocks.prefix_hit_tokens > 0
    assert len(engine.policy.leader.transitions) >= 3


@pytest.mark.parametrize("async_swap", [True, False], ids=["async", "sync"])
def test_more_prompts_than_sequence_seats_still_finish_with_one_process_text(
    no_leftover_segments,  # noqa: F811
    tiny_checkpoint,
    group_factory,
    engine_factory,
    async_swap,
):
    """Prompts parked on the host keep their seats: with every seat held and prompts still
    waiting, the prefill phase must end (before the fix it never did: the simulator found it),
    and the decode phase must not switch back while no seat is free (with asynchronous swaps it
    parked the sequences it had just swapped in, before they decoded, over and over)."""
    folder = _model(tiny_checkpoint)
    prompts = _prompts(7, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    ref = engine_factory(folder, kv_cache_bytes=2 * DEVICE_KV, **ENGINE)
    want = [o.token_ids for o in ref.generate(prompts, params)]
    policy = _seesaw(P2, T2, hostKvCapacityBytes=96 * 2048, asyncSwap=async_swap)
    engine = group_factory(
        folder, policy, kv_cache_bytes=DEVICE_KV, record=False, max_num_seqs=2, **ENGINE
    )
    got = [o.token_ids for o in engine.generate(prompts, params)]
    assert got == want
    assert any("seats taken" in t.reason for t in engine.policy.leader.transitions)
