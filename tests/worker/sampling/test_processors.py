"""logit_bias, allowed_token_ids, bad_words and grammar masks in the leader's sampler."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from gearshift.worker.sampling import InvalidSamplingParams, Sampler, SamplingParams, SamplingState
from gearshift.worker.sampling.processors import bad_word_bans
from gearshift.worker.structured import GrammarCompiler, GrammarSpec, InvalidGrammar
from gearshift.worker.tokenizer import Tokenizer

VOCAB = 8


def _sample(logits: torch.Tensor, *params: SamplingParams, out: list[int] | None = None) -> list:
    states = [SamplingState(p, output_token_ids=out or []) for p in params]
    return Sampler().sample(logits, states).token_ids


def test_logit_bias_moves_the_greedy_token_and_only_in_its_row() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 3] = 5.0
    biased = SamplingParams(temperature=0.0, logit_bias={3: -100.0, 6: 1.0})
    assert _sample(logits, biased, SamplingParams(temperature=0.0)) == [6, 3]


def test_allowed_token_ids_restrict_sampling_even_at_high_temperature() -> None:
    logits = torch.randn(1, VOCAB)
    params = SamplingParams(temperature=2.0, allowed_token_ids=[1, 5])
    picked = {_sample(logits.clone(), params)[0] for _ in range(40)}
    assert picked <= {1, 5} and picked


def test_bad_words_ban_the_last_token_only_after_its_prefix() -> None:
    assert bad_word_bans([(4,), (1, 2)], [7, 1]) == [4, 2]
    assert bad_word_bans([(1, 2)], [7, 3]) == []
    logits = torch.zeros(1, VOCAB)
    logits[0, 2] = 9.0
    params = SamplingParams(temperature=0.0, bad_words=[(1, 2)])
    assert _sample(logits, params, out=[1]) != [2]
    assert _sample(logits, params, out=[3]) == [2]


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("logit_bias", {"logit_bias": {1: 101.0}}),
        ("logit_bias", {"logit_bias": {-1: 1.0}}),
        ("allowed_token_ids", {"allowed_token_ids": [-3]}),
        ("bad_words", {"bad_words": [()]}),
    ],
)
def test_out_of_range_processor_values_are_refused_naming_the_field(
    field: str, kwargs: dict
) -> None:
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field


def test_token_ids_beyond_the_vocabulary_and_top_k_are_refused() -> None:
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(allowed_token_ids=[VOCAB]).check_vocabulary(VOCAB)
    assert info.value.field == "allowed_token_ids"
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(top_k=VOCAB + 1).check_vocabulary(VOCAB)
    assert info.value.field == "top_k"


@pytest.fixture(scope="module")
def grammars(smollm2_path: Path) -> tuple[Tokenizer, GrammarCompiler]:
    tok = Tokenizer.from_path(smollm2_path)
    return tok, GrammarCompiler(tok, tok.vocab_size, tok.eos_token_ids)


def _constrained_run(
    tok: Tokenizer, compiler: GrammarCompiler, spec: GrammarSpec, seed: int, steps: int = 60
) -> str:
    """Sample from random logits under the grammar until EOS: the mask alone shapes the text."""
    matcher = compiler.matcher(spec)
    params = SamplingParams(temperature=1.0, structured=spec)
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(steps):
        logits = torch.randn(1, tok.vocab_size, generator=gen) * 3
        state = SamplingState(params, gen, (), out, tok.eos_token_ids, matcher)
        token = Sampler().sample(logits, [state]).token_ids[0]
        if token in tok.eos_token_ids:
            return tok.decode(out)
        out.append(token)
    raise AssertionError(f"no EOS after {steps} tokens: {tok.decode(out)!r}")


def test_json_schema_grammar_forces_valid_json_from_random_logits(grammars) -> None:
    tok, compiler = grammars
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
    for seed in range(3):
        text = _constrained_run(tok, compiler, GrammarSpec("json_schema", json.dumps(schema)), seed)
        jsonschema.validate(json.loads(text), schema)


def test_choice_and_regex_grammars_match_exactly(grammars) -> None:
    tok, compiler = grammars
    choice = GrammarSpec("choice", choices=("red", "green", "blue"))
    assert _constrained_run(tok, compiler, choice, 0) in {"red", "green", "blue"}
    text = _constrained_run(tok, compiler, GrammarSpec("regex", r"[0-9]{3}-[a-z]{2}"), 1)
    assert len(text) == 6 and text[3] == "-" and text[:3].isdigit() and text[4:].isalpha()


@pytest.mark.parametrize(
    "spec",
    [
        GrammarSpec("json_schema", "{not json"),
        GrammarSpec("regex", "[a-"),
        GrammarSpec("grammar", "start: (("),
        GrammarSpec("choice"),
    ],
)
def test_invalid_grammars_are_refused_with_the_compilers_message(grammars, spec) -> None:
    _, compiler = grammars
    with pytest.raises(InvalidGrammar) as info:
        compiler.matcher(spec)
    assert str(info.value)
