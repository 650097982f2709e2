"""SmolLM2-135M-Instruct from its GGUF: greedy tokens equal transformers fp32 on the same file."""

from __future__ import annotations

import pytest
import torch

from gearshift.worker.sampling.params import SamplingParams

CHATS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain what a hash table is in one sentence.",
    "List three primary colors.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Give me a name for a friendly robot.",
    "Why is the sky blue? Answer briefly.",
]


@pytest.mark.slow
def test_greedy_chat_completions_equal_transformers(smollm2_path, hf_smollm2, engine_factory):
    hf_model, hf_tok = hf_smollm2
    engine = engine_factory(smollm2_path, record=False, max_model_len=512)
    prompts = [
        engine.tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS
    ]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    ours = engine.generate(prompts, params)
    for chat, prompt, out in zip(CHATS, prompts, ours, strict=True):
        # The chat template renders the same text; the ids are fed to both models as they are
        # (transformers' GGUF tokenizer conversion merges digits that SmolLM2 splits one by one).
        text = hf_tok.apply_chat_template(
            [{"role": "user", "content": chat}], tokenize=False, add_generation_prompt=True
        )
        assert engine.tokenizer.decode(prompt, skip_special_tokens=False) == text
        with torch.no_grad():
            ref = hf_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=2,
                pad_token_id=2,
            )[0, len(prompt) :].tolist()
        assert out.token_ids == ref, f"{chat!r}: {out.text!r} vs {hf_tok.decode(ref)!r}"
        assert out.text == engine.tokenizer.decode(ref)
