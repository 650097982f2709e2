"""SmolLM2 (9 heads, 3 KV heads) on 3 ranks: greedy tokens equal transformers fp32."""

from __future__ import annotations

import pytest
import torch

from gearshift.worker.sampling.params import SamplingParams

CHATS = [
    "What is the capital of France?",
    "Name three colors of the rainbow.",
    "Say hello in German.",
]
LAYOUTS = {
    "tp3": {"static": {"tp": 3}},
    "sp3": {"static": {"sp": 3}},
    "pp3": {"static": {"pp": 3}},
    "shift-sp3": {"shift": {"sp": 3, "threshold": 40}},
}

# Enough decode steps for both gears and every rank's shard to matter; each one costs a 3-process
# all-reduce round on a 2-core CI machine.
TOKENS = 12


@pytest.fixture(scope="module")
def expected(smollm2_path, hf_smollm2):
    from gearshift.worker.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_path(smollm2_path)
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    model, _ = hf_smollm2
    refs = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(
                torch.tensor([p]),
                max_new_tokens=TOKENS,
                do_sample=False,
                eos_token_id=2,
                pad_token_id=2,
            )
            refs.append(out[0, len(p) :].tolist())
    return prompts, refs


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_smollm2_on_three_ranks_matches_transformers(name, expected, smollm2_path, group_factory):
    prompts, refs = expected
    engine = group_factory(smollm2_path, LAYOUTS[name], record=False, max_model_len=256)
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=TOKENS))
    assert [o.token_ids for o in outs] == refs
    if name == "shift-sp3":
        # The 3 prompts prefill together (>40 tokens: base gear); decodes run the shift gear.
        steps = engine.stats().gear_steps
        assert steps["base"] >= 1 and steps["shift"] >= 1, steps
