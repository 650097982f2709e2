"""Seesaw: PP prefill <-> TP decode over a shared host KV store (gloo, fp32).

The workload is larger than the device KV cache, so prompts go through the host store and the
scheduler makes several transitions; greedy text must equal one process with the same weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gearshift.worker.policies.seesaw.host_kv import PREFIX, SHM_DIR
from gearshift.worker.policies.seesaw.leader import Phase
from gearshift.worker.policies.seesaw.policy import SeesawPolicy
from gearshift.worker.sampling.params import SamplingParams

BLOCK = 4
ENGINE = {
    "skip_tokenizer_init": True,
    "block_size": BLOCK,
    "max_num_batched_tokens": 32,
    "max_model_len": 64,
    "enable_prefix_caching": False,
}
# 4 layers x 2 KV heads x head_dim 8, fp32: 1 KiB per device block on each of two ranks, and
# 2 KiB per host page (every layer and head).
DEVICE_KV = 24 * 1024  # 24 blocks = 96 tokens per rank
HOST_KV = 28 * 2048  # 28 pages = 112 tokens


def _model(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=4)


def _prompts(n: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (6 + (5 * i) % 17,), generator=g).tolist() for i in range(n)]


def _seesaw(prefill: dict, decode: dict, **kw: object) -> dict:
    return {"seesaw": {"prefill": prefill, "decode": decode, "hostKvCapacityBytes": HOST_KV, **kw}}


def _segments() -> set[str]:
    return {p.name for p in SHM_DIR.glob(f"{PREFIX}*")}


@pytest.fixture
def no_leftover_segments():
    before = _segments()
    yield
    assert _segments() <= before, "a host KV segment outlived its group"


def _reference(engine_factory, folder: Path, prompts, params) -> list[list[int]]:
    ref = engine_factory(folder, record=False, kv_cache_bytes=64 << 20, **ENGINE)
    return [o.token_ids for o in ref.generate(prompts, params)]


@pytest.mark.parametrize(
    ("prefill", "decode"),
    [({"tp": 1, "pp": 2}, {"tp": 2, "pp": 1}), ({"tp": 2, "pp": 1}, {"tp": 1, "pp": 2})],
    ids=["P2-to-T2", "T2-to-P2"],
)
def test_greedy_text_equals_one_process_through_the_host_tier(
    no_leftover_segments, tiny_checkpoint, group_factory, engine_factory, prefill, decode
):
    folder = _model(tiny_checkpoint)
    prompts = _prompts(10)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = _reference(engine_factory, folder, prompts, params)
    engine = group_factory(
        folder, _seesaw(prefill, decode), kv_cache_bytes=DEVICE_KV, record=False, **ENGINE
    )
    got = [o.token_ids for o in engine.generate(prompts, params)]
    assert got == want
    policy = engine.policy
    assert isinstance(policy, SeesawPolicy) and policy.leader is not None
    log = policy.leader.transitions
    # The workload does not fit the device, nor the host store at once: several round trips.
    assert [t.to for t in log[:3]] == [Phase.DECODE, Phase.PREFILL, Phase.DECODE]
    assert policy.leader.pages.used == 0 and not policy.leader.on_host
    stats = policy.stats()
    assert stats["seesaw_swap_out_bytes"] > 0 and stats["seesaw_swap_in_bytes"] > 0
    assert stats["seesaw_transitions"] == len(log)
