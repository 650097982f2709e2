"""Logits of the paged, packed decoder equal Hugging Face transformers (fp32) for every family."""

from __future__ import annotations

import pytest
import torch

from gearshift.worker.sampling.params import SamplingParams
from tests.worker.helpers import FAMILIES, hf_logits, run_recording

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (23, 5, 41, 12)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers_in_mixed_prefill_decode_batches(
    family, tiny_checkpoint, engine_factory
):
    folder = tiny_checkpoint(family)
    # A small token budget chunks the long prompts; late arrivals mix prefills with decodes.
    engine = engine_factory(
        folder, skip_tokenizer_init=True, max_num_batched_tokens=16, block_size=4
    )
    p = _prompts(128)
    rows = run_recording(
        engine,
        {
            0: [("a", p[0], GREEDY), ("b", p[1], GREEDY)],
            2: [("c", p[2], GREEDY)],
            4: [("d", p[3], GREEDY)],
        },
    )
    steps = engine.executor.records
    assert any(plan.num_decodes and plan.prefill_query_lens for plan, _ in steps), "no mixed step"
    assert any(
        len(plan.prefill_query_lens) and max(plan.prefill_query_lens) < 41 for plan, _ in steps
    )
    for rid, entries in rows.items():
        assert len(entries) == GREEDY.max_tokens, rid
        full = entries[-1][0]
        ref = hf_logits(folder, full)
        for context, logits in entries:
            expected = ref[len(context) - 1]
            torch.testing.assert_close(
                logits, expected, atol=2e-5, rtol=1e-4, msg=f"{family} {rid}"
            )


def test_hf_config_keys_of_both_transformers_generations_load():
    from gearshift.worker.model.config import ModelConfig

    base = {
        "model_type": "llama",
        "vocab_size": 10,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    old = ModelConfig.from_hf_dict(
        {**base, "rope_theta": 5e5, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    )
    new = ModelConfig.from_hf_dict(
        {**base, "rope_parameters": {"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0}}
    )
    assert old.rope == new.rope
    assert old.rope.kind == "linear" and old.rope.theta == 5e5


def test_unsupported_architecture_is_named():
    from gearshift.worker.errors import UnsupportedModelError
    from gearshift.worker.model.config import ModelConfig

    with pytest.raises(UnsupportedModelError, match="gpt2"):
        ModelConfig.from_hf_dict(
            {
                "model_type": "gpt2",
                "vocab_size": 10,
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
            }
        )
