"""Seesaw's GPU-minded paths on CPU (issue 32, item 4): each gear goes to host memory as soon as
it is built, so the rank's start-up peak, counted by the engine's own ledger
(engine/device_memory.py), is one gear's shard plus the KV cache (plus each gear's rotary
tables), not two shards; swap-ins wait on the readiness board for the swap-outs before them,
not on a barrier of the group; and the group still gives one process's greedy tokens."""

from __future__ import annotations

import pytest

from gearshift.worker.engine.device_memory import storage_bytes
from gearshift.worker.policies.seesaw.policy import SeesawPolicy
from gearshift.worker.policies.seesaw.rank_hook import SWAP_IN, SWAP_OUT
from gearshift.worker.sampling.params import SamplingParams
from tests.worker.policies import test_seesaw as base


@pytest.mark.parametrize(
    ("prefill", "decode", "kv_bytes"),
    [
        ({"tp": 1, "pp": 2}, {"tp": 2, "pp": 1}, base.DEVICE_KV),
        ({"tp": 1, "pp": 1}, {"tp": 1, "pp": 1}, 2 * base.DEVICE_KV),  # every head on the one rank
    ],
    ids=["P2-to-T2", "one-rank"],
)
def test_the_start_up_peak_is_one_shard_plus_the_kv_cache(
    tiny_checkpoint, group_factory, engine_factory, prefill, decode, kv_bytes
):
    folder = base._model(tiny_checkpoint)
    engine = group_factory(
        folder, base._seesaw(prefill, decode), kv_cache_bytes=kv_bytes, **base.ENGINE
    )
    policy = engine.policy
    assert isinstance(policy, SeesawPolicy) and policy.ledger is not None
    assert policy.weights is not None and policy.hook is not None
    ledger, weights = policy.ledger, policy.weights
    device = weights.working.device
    # The bound, from what the rank holds now: the larger gear's host shard, the KV buffer, and
    # the rotary tables each gear keeps on the device.
    shard = max(weights.gear_bytes)
    kv = storage_bytes([policy.hook.kv.buffer], device)
    tables = sum(storage_bytes(m.buffers(), device) for m in weights.models)
    assert kv > 0 and min(weights.gear_bytes) > tables
    assert ledger.peak <= shard + kv + tables, ledger.events
    # Both shards at once (what building every gear on the device before stashing cost) would
    # exceed it; the order shows why: each gear is stashed before the next is built, the
    # working set comes after both, the KV cache last.
    assert ledger.peak < sum(weights.gear_bytes) + kv
    order = [what.split(" holds")[0] for what, _ in ledger.events]
    assert order == [
        "prefill gear",
        "prefill gear",
        "decode gear",
        "decode gear",
        "seesaw working set",
        "kv cache",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = base._prompts(4)
    want = base._reference(engine_factory, folder, prompts, params)
    assert [o.token_ids for o in engine.generate(prompts, params)] == want


@pytest.mark.parametrize("async_swap", [True, False], ids=["async", "sync"])
def test_swap_ins_wait_on_the_board_not_on_a_group_barrier(
    tiny_checkpoint, group_factory, engine_factory, async_swap
):
    folder = base._model(tiny_checkpoint)
    engine = group_factory(
        folder,
        base._seesaw({"tp": 1, "pp": 2}, {"tp": 2, "pp": 1}, asyncSwap=async_swap),
        kv_cache_bytes=base.DEVICE_KV,
        **base.ENGINE,
    )
    hook = engine.policy.hook
    barriers = []
    group_barrier = hook.barrier

    def counted() -> None:
        barriers.append(hook.plans_begun)
        group_barrier()

    hook.barrier = counted  # rank 0's: every rank calls it at the same plans
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = base._prompts(10)
    want = base._reference(engine_factory, folder, prompts, params)
    assert [o.token_ids for o in engine.generate(prompts, params)] == want
    plans = engine.executor.submitted
    outs = [k + 1 for k, p in enumerate(plans) if p.section(SWAP_OUT) is not None]
    ins = [k + 1 for k, p in enumerate(plans) if p.section(SWAP_IN) is not None]
    assert outs and ins, "the workload went through the host store"
    # Synchronous swap-outs still meet (a page may be rewritten once its reader is done);
    # no swap-in does: each waited on the board for the swap-outs before it.
    assert barriers == ([] if async_swap else outs)
    board = engine.policy.hook.board
    assert board.wait_written(len(outs), timeout=30)  # every rank reports every swap-out
    assert int(board.out_slots.max()) == len(outs)
