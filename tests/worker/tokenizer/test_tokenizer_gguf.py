"""Tokenizer built from GGUF metadata: SmolLM2 (byte-level BPE) and a tiny SentencePiece vocab."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from gearshift.worker.tokenizer import Tokenizer
from gearshift.worker.tokenizer.gguf_metadata import read_gguf_metadata

ROUND_TRIP_TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew\n\nlines\r\n",
    "Café naïve façade – résumé",
    "日本語のテキストと中文文本",
    "emoji 🎉👩‍👩‍👧‍👦🇫🇷 mixed ✓",
    "def f(x):\n    return x ** 2  # code",
    "Year 2024: 12.5% better, 3,000,000 users",
    "<|im_start|>user\nhi<|im_end|>",
]
# Digit-free: transformers' GGUF loader does not split digits (see the digits test below).
REFERENCE_TEXTS = [t for t in ROUND_TRIP_TEXTS if not any(c.isdigit() for c in t)]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_smollm_encode_decode_round_trips(smollm_tokenizer: Tokenizer, text: str) -> None:
    ids = smollm_tokenizer.encode(text, add_special_tokens=False)
    assert smollm_tokenizer.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("text", REFERENCE_TEXTS)
def test_smollm_ids_match_transformers(
    smollm_tokenizer: Tokenizer, hf_smollm_tokenizer: Any, text: str
) -> None:
    assert smollm_tokenizer.encode(text) == hf_smollm_tokenizer.encode(text)


def test_smollm_splits_digits_one_by_one_like_its_reference_tokenizer(
    smollm_tokenizer: Tokenizer,
) -> None:
    # SmolLM2's tokenizer.json pre-splits digits (Digits(individual_digits=True)) and llama.cpp's
    # "smollm" pre-tokenizer does too; transformers' GGUF loader does not.
    ids = smollm_tokenizer.encode("2024", add_special_tokens=False)
    assert [smollm_tokenizer.decode([i]) for i in ids] == ["2", "0", "2", "4"]


def test_smollm_special_ids(smollm_tokenizer: Tokenizer) -> None:
    assert 2 in smollm_tokenizer.eos_token_ids
    assert smollm_tokenizer.eos_token_id == 2
    assert smollm_tokenizer.bos_token_id == 1
    assert smollm_tokenizer.vocab_size == 49152
    assert {0, 1, 2} <= smollm_tokenizer.all_special_ids
    # The GGUF says add_bos_token = false: plain encoding adds nothing.
    assert smollm_tokenizer.encode("hi") == smollm_tokenizer.encode("hi", add_special_tokens=False)


def test_smollm_special_tokens_encode_whole_and_are_skipped_on_decode(
    smollm_tokenizer: Tokenizer,
) -> None:
    ids = smollm_tokenizer.encode("<|im_start|>hi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert smollm_tokenizer.decode(ids) == "hi"
    assert smollm_tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>hi<|im_end|>"


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Tell me a joke about café owners 🎉"},
    ],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_smollm_chat_template_matches_transformers(
    smollm_tokenizer: Tokenizer,
    hf_smollm_tokenizer: Any,
    messages: list[dict[str, str]],
    add_generation_prompt: bool,
) -> None:
    expected_text = hf_smollm_tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    expected_ids = hf_smollm_tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    assert smollm_tokenizer.has_chat_template
    text = smollm_tokenizer.apply_chat_template_text(messages, add_generation_prompt)
    assert text == expected_text
    assert smollm_tokenizer.apply_chat_template(messages, add_generation_prompt) == expected_ids


@pytest.mark.slow
def test_gguf_metadata_reader_agrees_with_the_gguf_package(smollm_gguf: Path) -> None:
    import gguf

    ours = read_gguf_metadata(smollm_gguf)
    reader = gguf.GGUFReader(str(smollm_gguf))
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue  # header pseudo-fields, not metadata
        assert ours[key] == field.contents(), key
    assert ours["tokenizer.ggml.tokens"][2] == "<|im_end|>"


def test_sentencepiece_gguf_matches_transformers(
    sentencepiece_gguf: Path, sentencepiece_tokenizer: Tokenizer
) -> None:
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(
        str(sentencepiece_gguf.parent), gguf_file=sentencepiece_gguf.name
    )
    for text in ["hello world", " hello  world!", "héllo, wörld 世", "cat hat the world", "   "]:
        ids = sentencepiece_tokenizer.encode(text)
        assert ids == reference.encode(text), text
        assert sentencepiece_tokenizer.decode(ids) == reference.decode(
            ids, skip_special_tokens=True
        )


def test_sentencepiece_gguf_adds_bos_and_falls_back_to_bytes(
    sentencepiece_tokenizer: Tokenizer,
) -> None:
    tok = sentencepiece_tokenizer
    ids = tok.encode("hello é")
    assert ids[0] == tok.bos_token_id == 1
    assert tok.encode("hello", add_special_tokens=False) == ids[1:2]
    assert tok.convert_ids_to_tokens(ids[1:]) == ["▁hello", "▁", "<0xC3>", "<0xA9>"]
    assert tok.decode(ids) == "hello é"
    assert tok.eos_token_ids == frozenset({2})


@pytest.mark.slow
def test_tokenizer_package_never_imports_torch(smollm_gguf: Path) -> None:
    # The router tokenises in a process that must not pay for (or depend on) torch.
    script = textwrap.dedent(
        f"""
        import sys
        from gearshift.worker.tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer
        tok = Tokenizer.from_path({str(smollm_gguf)!r})
        ids = tok.apply_chat_template([{{"role": "user", "content": "hi"}}])
        detok = IncrementalDetokenizer(tok, ids)
        StopChecker(["x"]).feed(detok.step(tok.encode("hello")))
        assert "torch" not in sys.modules, "torch was imported"
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
