"""Seesaw keeps device KV across gear switches where it is valid (issue 29, Build 2).

The device KV is block-major (rank_hook.DeviceKV): block b of one gear shares memory only with
block b of the other. So sequences still decoding at a switch to prefill keep their blocks and
decode again in the next decode phase with no copy, parked on the host only when the prefill
phase needs their blocks (youngest first, as many as needed); and prefix-cache entries, tagged
with the gear whose view wrote them, survive the switches (P2 -> T2, 2 gloo ranks, fp32).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gearshift.worker.engine.llm_engine import LLMEngine
from gearshift.worker.policies.seesaw.leader import SWAP_OUT_KEPT, Phase
from gearshift.worker.sampling.params import SamplingParams
from tests.worker.policies.test_seesaw import (
    BLOCK,
    DEVICE_KV,
    ENGINE,
    _model,
    _prompts,
    _seesaw,
    no_leftover_segments,  # noqa: F401 - a fixture
)

P2, T2 = {"tp": 1, "pp": 2}, {"tp": 2, "pp": 1}
PAGE_BYTES = 2048  # 4 layers x 2 KV heads x 4 tokens x head_dim 8, fp32, keys and values
STEP_LIMIT = 400


def _pages(prompt: list[int]) -> int:
    return -(-len(prompt) // BLOCK)


def _run_until(engine: LLMEngine, done: Callable[[], bool], got: dict[str, list[int]]) -> None:
    """Step ``engine`` (collecting tokens) until ``done()``; bounded."""
    for _ in range(STEP_LIMIT):
        if done():
            return
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError(f"not reached within {STEP_LIMIT} steps")


def _decoding_then_more_prompts(
    engine: LLMEngine,
    first: dict[str, list[int]],
    second: dict[str, list[int]],
    params: SamplingParams,
    also: Callable[[], None] | None = None,
) -> dict[str, list[int]]:
    """``first`` prefilled and decoding in the decode phase, then ``second`` arrives: the
    switch to prefill finds the first still decoding. Runs everything to the end."""
    lead = engine.policy.leader
    got: dict[str, list[int]] = {}
    for rid, prompt in first.items():
        engine.add_request(rid, prompt, params)

    def decoding() -> bool:
        return lead.phase is Phase.DECODE and all(len(got.get(r, [])) >= 3 for r in first)

    _run_until(engine, decoding, got)
    assert not lead.on_host and not lead.queue  # every first sequence is on the device
    for rid, prompt in second.items():
        engine.add_request(rid, prompt, params)
    _run_until(engine, lambda: lead.phase is Phase.PREFILL, got)
    if also is not None:
        also()
    _run_until(engine, lambda: not engine.has_unfinished_requests(), got)
    return got


def _want(engine_factory, folder, prompts: dict[str, list[int]], params) -> dict[str, list[int]]:
    ref = engine_factory(folder, record=False, kv_cache_bytes=64 << 20, **ENGINE)
    outs = ref.generate(list(prompts.values()), params)
    return {rid: o.token_ids for rid, o in zip(prompts, outs, strict=True)}


@pytest.mark.parametrize("async_swap", [True, False], ids=["async", "sync"])
def test_a_switch_to_prefill_with_enough_free_blocks_parks_no_decoding_sequence(
    no_leftover_segments,  # noqa: F811
    tiny_checkpoint,
    group_factory,
    engine_factory,
    async_swap,
):
    folder = _model(tiny_checkpoint)
    pool = _prompts(6, seed=21)
    # 6 and 11 tokens, then 15 and 14: with 8 generated each, 21 of the 24 device blocks at the
    # end, so no sequence is parked for growth either; at the switch ~7 are held, 17 free.
    first = {"a0": pool[0], "a1": pool[1]}
    second = {"b0": pool[4], "b1": pool[5]}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = _want(engine_factory, folder, {**first, **second}, params)

    policy = _seesaw(P2, T2, asyncSwap=async_swap)
    engine = group_factory(folder, policy, kv_cache_bytes=DEVICE_KV, **ENGINE)
    lead = engine.policy.leader
    kept_at_switch: list[set[str]] = []

    def at_switch() -> None:
        kept_at_switch.append(set(lead.kept.seqs))

    got = _decoding_then_more_prompts(engine, first, second, params, at_switch)
    assert got == want
    stats = engine.policy.stats()
    assert kept_at_switch == [set(first)]  # both stayed on the device at the switch
    assert stats["kept_sequences"] == 2 and stats["kept_parked_sequences"] == 0
    # Each prompt's KV went to the host once, after its prefill: no decoding sequence did.
    plans = engine.executor.submitted
    assert not any(p.section(SWAP_OUT_KEPT) is not None for p in plans)
    pages = sum(_pages(p) for p in [*first.values(), *second.values()])
    assert lead.swap_out_bytes == pages * PAGE_BYTES
    assert stats["parked_sequences"] == 0
    stats_all = engine.stats()
    assert stats_all.num_preemptions == 0 and stats_all.preempted_tokens == 0
    assert [t.to for t in lead.transitions] == [Phase.DECODE, Phase.PREFILL, Phase.DECODE]


@pytest.mark.parametrize("async_swap", [True, False], ids=["async", "sync"])
def test_a_prompt_that_needs_kept_blocks_parks_only_the_youngest_it_needs(
    no_leftover_segments,  # noqa: F811
    monkeypatch,
    tiny_checkpoint,
    group_factory,
    engine_factory,
    async_swap,
):
    folder = _model(tiny_checkpoint)
    pool = _prompts(12, seed=23)
    # Three 16..22-token prompts decoding up to 24 tokens hold ~6 of the 24 device blocks each;
    # the next prompt (62 tokens: 16 blocks) fits once one or two of them leave.
    first = {"a0": pool[3], "a1": pool[6], "a2": pool[9]}
    second = {"b0": (pool[10] * 4)[:62]}
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    long = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = engine_factory(folder, record=False, kv_cache_bytes=64 << 20, **ENGINE)
    want = {
        rid: ref.generate([p], long if rid in first else short)[0].token_ids
        for rid, p in {**first, **second}.items()
    }

    # A host store large enough that parking every decoding sequence costs the prompt nothing
    # (else the leader would not switch while they decode: leader._parking_is_free).
    policy = _seesaw(P2, T2, asyncSwap=async_swap, hostKvCapacityBytes=64 * PAGE_BYTES)
    engine = group_factory(folder, policy, kv_cache_bytes=DEVICE_KV, **ENGINE)
    lead = engine.policy.leader
    seen: list[tuple[int, int, list[str], list[list[int]], list[str]]] = []
    plan_parking = lead.kept.plan_parking

    def spy(need, free_blocks, free_pages, block_size, own):  # type: ignore[no-untyped-def]
        plan = plan_parking(need, free_blocks, free_pages, block_size, own)
        kept = list(lead.kept.seqs.values())
        blocks = [list(s.blocks.block_ids) for s in kept]
        seen.append((need, free_blocks, [s.request_id for s in kept], blocks,
                     [s.request_id for s in plan.victims]))  # fmt: skip
        return plan

    monkeypatch.setattr(lead.kept, "plan_parking", spy)
    got: dict[str, list[int]] = {}
    for rid, prompt in first.items():
        engine.add_request(rid, prompt, long)
    _run_until(
        engine,
        lambda: lead.phase is Phase.DECODE and all(len(got.get(r, [])) >= 3 for r in first),
        got,
    )
    engine.add_request("b0", second["b0"], short)
    _run_until(engine, lambda: not engine.has_unfinished_requests(), got)
    assert got == want
    assert len(seen) == 1, seen  # one decision to park, at the one switch to prefill
    need, free, kept, blocks, victims = seen[0]
    assert need == _pages(second["b0"]) > free and kept == list(first)
    # The fewest of the youngest whose blocks make room (worked out here, not by keep.py).
    expect, room = [], free
    for rid, held in zip(reversed(kept), reversed(blocks), strict=True):
        if room >= need:
            break
        expect.append(rid)
        room += len(held)
    assert 0 < len(expect) < len(kept) and victims == expect
    # Their KV left from the decode gear's view, in a prefill-gear plan, and nobody else's.
    parking = [p for p in engine.executor.submitted if p.section(SWAP_OUT_KEPT) is not None]
    assert len(parking) == 1 and parking[0].gear == 0
    section = parking[0].section(SWAP_OUT_KEPT)
    assert section is not None and int(section[0]) == 1  # the decode gear's view
    moved = set(section[1:].view(-1, 2)[:, 1].tolist())
    assert moved == {
        b for rid, held in zip(kept, blocks, strict=True) if rid in expect for b in held
    }
    stats = engine.policy.stats()
    assert stats["kept_sequences"] == 3 and stats["kept_parked_sequences"] == len(expect)
    assert engine.stats().num_preemptions == 0


def test_a_prefix_written_in_one_prefill_phase_hits_in_the_next_after_two_switches(
    no_leftover_segments,  # noqa: F811
    tiny_checkpoint,
    group_factory,
    engine_factory,
):
    folder = _model(tiny_checkpoint)
    shared = _prompts(3, seed=9)[2][:12]  # three full blocks both prompts start with
    tails = _prompts(4, seed=13)
    first = {"a": shared + tails[2]}
    second = {"b": shared + tails[3]}
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    cached = {**ENGINE, "enable_prefix_caching": True}
    ref = engine_factory(folder, record=False, kv_cache_bytes=64 << 20, **cached)
    want = {rid: ref.generate([p], params)[0].token_ids for rid, p in {**first, **second}.items()}

    engine = group_factory(folder, _seesaw(P2, T2), kv_cache_bytes=DEVICE_KV, **cached)
    lead = engine.policy.leader
    got: dict[str, list[int]] = {}
    engine.add_request("a", first["a"], params)
    _run_until(engine, lambda: not engine.has_unfinished_requests(), got)
    assert engine.blocks.prefix_hit_tokens == 0
    assert [t.to for t in lead.transitions] == [Phase.DECODE]
    engine.add_request("b", second["b"], params)
    seq = engine.requests["b"]
    _run_until(engine, lambda: not engine.has_unfinished_requests(), got)
    assert got == want
    # "b" was admitted in the second prefill phase and hit "a"'s blocks, written in the first
    # (in the prefill gear's view), through a switch to decode and one back.
    assert [t.to for t in lead.transitions][:2] == [Phase.DECODE, Phase.PREFILL]
    assert seq.num_cached_tokens == len(shared)
    assert engine.blocks.prefix_hit_tokens == len(shared)


def test_a_kept_sequence_aborted_in_the_prefill_phase_frees_its_blocks_and_pages(
    no_leftover_segments,  # noqa: F811
    tiny_checkpoint,
    group_factory,
    engine_factory,
):
    folder = _model(tiny_checkpoint)
    pool = _prompts(6, seed=21)
    first = {"a0": pool[0], "a1": pool[1]}
    second = {"b0": pool[4], "b1": pool[5]}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = _want(engine_factory, folder, {"a0": pool[0], **second}, params)

    engine = group_factory(folder, _seesaw(P2, T2), kv_cache_bytes=DEVICE_KV, **ENGINE)
    lead = engine.policy.leader
    freed: list[int] = []

    def abort_a_kept_one() -> None:
        assert set(lead.kept.seqs) == set(first)
        seq = lead.kept.seqs["a1"]
        blocks = list(seq.blocks.block_ids)
        free = engine.blocks.num_free_blocks
        assert blocks and engine.abort_request("a1")
        assert "a1" not in lead.kept and "a1" not in lead.held()
        assert lead.pages.held.get("a1") is None  # no host page either
        freed.append(engine.blocks.num_free_blocks - free)
        freed.append(len(blocks))

    got = _decoding_then_more_prompts(engine, first, second, params, abort_a_kept_one)
    del got["a1"]
    assert got == want
    assert freed[0] == freed[1] > 0  # every block it held, at once (none was in flight)
    assert lead.pages.used == 0 and not lead.on_host and not lead.draining and not lead.kept
    assert engine.policy.stats()["kept_parked_sequences"] == 0
