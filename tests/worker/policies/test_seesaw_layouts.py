"""Seesaw over more layouts: TP2xPP2 -> TP4 on four ranks, and P3 -> T3 on SmolLM2 (9 heads,
3 KV heads, 30 layers). Greedy tokens equal one process with the same weights (fp32)."""

from __future__ import annotations

import pytest

from gearshift.worker.sampling.params import SamplingParams
from tests.worker.policies.test_seesaw import (
    DEVICE_KV,
    ENGINE,
    _model,
    _prompts,
    _seesaw,
    no_leftover_segments,  # noqa: F401 - a fixture
)


def test_tp2_pp2_prefill_to_tp4_decode_on_four_ranks(
    no_leftover_segments,  # noqa: F811
    tiny_checkpoint,
    group_factory,
    engine_factory,
):
    folder = _model(tiny_checkpoint)
    prompts = _prompts(8)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ref = engine_factory(folder, record=False, kv_cache_bytes=64 << 20, **ENGINE)
    want = [o.token_ids for o in ref.generate(prompts, params)]
    policy = _seesaw({"tp": 2, "pp": 2}, {"tp": 4, "pp": 1})
    engine = group_factory(folder, policy, kv_cache_bytes=DEVICE_KV, record=False, **ENGINE)
    assert [o.token_ids for o in engine.generate(prompts, params)] == want
    assert len(engine.policy.leader.transitions) >= 3


CHATS = [
    "What is the capital of France?",
    "Name three colors of the rainbow.",
    "Say hello in German.",
    "What is two plus two?",
    "Name a large animal.",
    "What colour is the sky?",
]
# SmolLM2 per rank, fp32, 16-token blocks: 10 layers x 3 KV heads (P3) = 30 layers x 1 (T3) =
# 240 KiB per block; a host page holds every layer and head: 720 KiB.
SMOL_BLOCK = 240 * 1024
SMOL_PAGE = 720 * 1024


@pytest.mark.slow
def test_smollm2_p3_prefill_to_t3_decode_equals_one_process(
    no_leftover_segments,  # noqa: F811
    smollm2_path,
    group_factory,
    engine_factory,
):
    from gearshift.worker.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_path(smollm2_path)
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    kw = {"max_model_len": 96, "skip_tokenizer_init": True, "enable_prefix_caching": False}
    ref = engine_factory(smollm2_path, record=False, kv_cache_bytes=64 << 20, **kw)
    want = [o.token_ids for o in ref.generate(prompts, params)]
    policy = {
        "seesaw": {
            "prefill": {"tp": 1, "pp": 3},
            "decode": {"tp": 3, "pp": 1},
            "hostKvCapacityBytes": 10 * SMOL_PAGE,
        }
    }
    engine = group_factory(smollm2_path, policy, kv_cache_bytes=8 * SMOL_BLOCK, record=False, **kw)
    assert [o.token_ids for o in engine.generate(prompts, params)] == want
    assert len(engine.policy.leader.transitions) >= 3
