"""Seesaw's device memory at start (issue 32, item 4): each gear goes to host memory as soon as
it is built, so the rank's peak, counted by the engine's own ledger (engine/device_memory.py),
is one gear's shard plus the KV cache (plus each gear's rotary tables), not two shards; and the
group still gives one process's greedy tokens."""

from __future__ import annotations

import pytest

from gearshift.worker.engine.device_memory import storage_bytes
from gearshift.worker.policies.seesaw.policy import SeesawPolicy
from gearshift.worker.sampling.params import SamplingParams
from tests.worker.policies.test_seesaw import (
    DEVICE_KV,
    ENGINE,
    _model,
    _prompts,
    _reference,
    _seesaw,
)


@pytest.mark.parametrize(
    ("prefill", "decode", "kv_bytes"),
    [
        ({"tp": 1, "pp": 2}, {"tp": 2, "pp": 1}, DEVICE_KV),
        ({"tp": 1, "pp": 1}, {"tp": 1, "pp": 1}, 2 * DEVICE_KV),  # every head on the one rank
    ],
    ids=["P2-to-T2", "one-rank"],
)
def test_the_start_up_peak_is_one_shard_plus_the_kv_cache(
    tiny_checkpoint, group_factory, engine_factory, prefill, decode, kv_bytes
):
    folder = _model(tiny_checkpoint)
    engine = group_factory(folder, _seesaw(prefill, decode), kv_cache_bytes=kv_bytes, **ENGINE)
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
    prompts = _prompts(4)
    want = _reference(engine_factory, folder, prompts, params)
    assert [o.token_ids for o in engine.generate(prompts, params)] == want
