"""The sampler never reads a device value before the chosen ids (issue 27: no host syncs).

``Sampler.choose`` runs here on ``meta`` tensors, which have no data: any read of a device value
(``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``, ``.cpu()``, ``nonzero``) raises, so a sampling
feature that makes the host wait for the device fails its case. Every feature runs: greedy,
temperature, top-k, top-p, min-p, seeds, penalties, logit bias, allowed ids, bad words, min_tokens
and a grammar mask.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gearshift.worker.sampling import Sampler, SamplingParams, SamplingState
from gearshift.worker.structured import GrammarCompiler, GrammarSpec
from gearshift.worker.tokenizer.tokenizer import Tokenizer

VOCAB = 1000
META = torch.device("meta")

CASES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature": SamplingParams(temperature=0.7),
    "top_k": SamplingParams(temperature=1.0, top_k=20),
    "top_p": SamplingParams(temperature=1.0, top_p=0.8),
    "top_k_top_p": SamplingParams(temperature=1.0, top_k=50, top_p=0.9),
    "min_p": SamplingParams(temperature=1.0, min_p=0.1),
    "seed": SamplingParams(temperature=1.0, seed=7),
    "penalties": SamplingParams(
        temperature=0.0, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3
    ),
    "logit_bias": SamplingParams(temperature=0.0, logit_bias={5: 3.0, 9: -100.0}),
    "allowed": SamplingParams(temperature=1.0, allowed_token_ids=[1, 2, 3]),
    "bad_words": SamplingParams(temperature=0.0, bad_words=[[4, 5], [6]]),
    "min_tokens": SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=[3]),
}


def _state(params: SamplingParams, grammar=None) -> SamplingState:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    return SamplingState(params, gen, [1, 2, 3, 4], [4, 2], frozenset({0}), grammar)


def test_meta_tensors_cannot_be_read_so_the_test_would_catch_a_read() -> None:
    logits = torch.zeros(2, VOCAB, device=META)
    for read in (lambda: logits.tolist(), lambda: bool(logits.any()), lambda: int(logits.max())):
        with pytest.raises((RuntimeError, NotImplementedError)):
            read()


@pytest.mark.parametrize("name", list(CASES))
def test_each_sampling_feature_chooses_without_reading_the_device(name: str) -> None:
    states = [_state(CASES[name]), _state(SamplingParams(temperature=0.0))]
    ids = Sampler().choose(torch.zeros(2, VOCAB, device=META), states)
    assert ids.device == META and ids.shape == (2,) and ids.dtype == torch.int64


def test_a_batch_mixing_every_feature_chooses_without_reading_the_device() -> None:
    states = [_state(p) for p in CASES.values()]
    ids = Sampler().choose(torch.zeros(len(states), VOCAB, device=META), states)
    assert ids.shape == (len(states),)


def test_a_grammar_mask_is_applied_without_reading_the_device(smollm2_path: Path) -> None:
    tok = Tokenizer.from_path(smollm2_path)
    compiler = GrammarCompiler(tok, tok.vocab_size, tok.eos_token_ids)
    spec = GrammarSpec("choice", choices=("red", "green"))
    params = SamplingParams(temperature=1.0, structured=spec)
    state = SamplingState(params, None, (), [], tok.eos_token_ids, compiler.matcher(spec))
    ids = Sampler().choose(torch.zeros(1, tok.vocab_size, device=META), [state])
    assert ids.shape == (1,)


def test_choose_is_what_sample_returns_on_the_cpu() -> None:
    torch.manual_seed(0)
    logits = torch.randn(len(CASES), VOCAB) * 3
    sampled = Sampler(torch.Generator().manual_seed(3)).sample(
        logits, [_state(p) for p in CASES.values()]
    )
    chosen = Sampler(torch.Generator().manual_seed(3)).choose(
        logits, [_state(p) for p in CASES.values()]
    )
    assert sampled.token_ids == chosen.tolist()
