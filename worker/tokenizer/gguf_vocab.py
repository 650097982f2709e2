"""Build a Hugging Face `tokenizers.Tokenizer` from the vocabulary stored in GGUF metadata.

A GGUF carries no tokenizer.json, only llama.cpp's keys (`tokenizer.ggml.*`). We rebuild the
tokenizer llama.cpp would run: byte-level BPE for `gpt2` vocabularies (Llama 3, Qwen2, SmolLM)
with the pre-tokenizer named by `tokenizer.ggml.pre`, and SentencePiece-style BPE with byte
fallback for `llama` vocabularies (Llama 2, Mistral).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from gearshift.worker.tokenizer.errors import TokenizerLoadError
from gearshift.worker.tokenizer.gguf_metadata import MetadataValue

logger = logging.getLogger(__name__)

# llama.cpp token types (gguf.TokenType).
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Pre-tokenizer names (llama.cpp's `tokenizer.ggml.pre`) that split with a custom regex.
_REGEX_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# These split every digit on its own before the GPT-2 regex (llama.cpp's `\p{N}` rule, the
# `Digits(individual_digits=True)` of their tokenizer.json). transformers' GGUF loader misses
# this and encodes "2024" as one piece where the model was trained on four.
_DIGIT_SPLITS = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_PLAIN_GPT2 = {"default", "gpt2", "gpt-2", "olmo", "jais", "poro-chat", "viking", "bloom"}


@dataclass(frozen=True)
class GGUFTokenizer:
    """A tokenizer rebuilt from GGUF metadata, plus the special tokens the file names."""

    backend: Tokenizer
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    special_tokens: dict[str, str]
    chat_template: str | None


def build_gguf_tokenizer(path: Path, metadata: dict[str, MetadataValue]) -> GGUFTokenizer:
    """The tokenizer described by `metadata` (read from the GGUF at `path`)."""
    embedded = metadata.get("tokenizer.huggingface.json")
    tokens = _string_list(path, metadata, "tokenizer.ggml.tokens")
    kind = metadata.get("tokenizer.ggml.model")
    if isinstance(embedded, str):
        # Some converters embed the original tokenizer.json: nothing to rebuild.
        backend = Tokenizer.from_str(embedded)
    elif kind == "gpt2":
        backend = _byte_level_bpe(path, metadata, tokens)
    elif kind == "llama":
        backend = _sentencepiece_bpe(path, metadata, tokens)
    else:
        raise TokenizerLoadError(path, f"unsupported GGUF tokenizer model {kind!r}")
    if not isinstance(embedded, str):
        _add_special_tokens(backend, metadata, tokens)
        _set_post_processor(backend, metadata, tokens, default_bos=kind == "llama")

    def token_at(key: str) -> int | None:
        return _token_id(metadata, key, len(tokens))

    bos = token_at("tokenizer.ggml.bos_token_id")
    # EOT/EOM end a turn in Llama 3 chat formats; llama.cpp stops on them like on EOS.
    eos_keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    eos_ids = [i for key in eos_keys if (i := token_at(f"tokenizer.ggml.{key}")) is not None]
    special: dict[str, str] = {}
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token_id = token_at(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            special[f"{name}_token"] = tokens[token_id]
    template = metadata.get("tokenizer.chat_template")
    return GGUFTokenizer(
        backend=backend,
        bos_token_id=bos,
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        special_tokens=special,
        chat_template=template if isinstance(template, str) else None,
    )


def _string_list(path: Path, metadata: dict[str, MetadataValue], key: str) -> list[str]:
    value = metadata.get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TokenizerLoadError(path, f"GGUF metadata has no string list {key!r}")
    return [str(v) for v in value]


def _token_id(metadata: dict[str, MetadataValue], key: str, vocab_size: int) -> int | None:
    value = metadata.get(key)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size:
        return value
    return None


def _merge_pair(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right


def _vocab(tokens: Sequence[str]) -> dict[str, int]:
    # A duplicated token keeps its first id, as llama.cpp's token-to-id map does.
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    return vocab


def _byte_level_bpe(path: Path, metadata: dict[str, MetadataValue], tokens: list[str]) -> Tokenizer:
    merges = [_merge_pair(m) for m in _string_list(path, metadata, "tokenizer.ggml.merges")]
    model = BPE(vocab=_vocab(tokens), merges=merges, fuse_unk=False, byte_fallback=False)
    backend = Tokenizer(model)
    pre = str(metadata.get("tokenizer.ggml.pre", "default"))
    if pre in _REGEX_SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_REGEX_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre in _DIGIT_SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        if pre not in _PLAIN_GPT2:
            logger.warning("GGUF pre-tokenizer %r is unknown; using the GPT-2 split", pre)
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_merges(tokens: list[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary: a token's score ranks the merge making it."""
    vocab = _vocab(tokens)
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, score in zip(tokens, scores, strict=False):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _sentencepiece_bpe(
    path: Path, metadata: dict[str, MetadataValue], tokens: list[str]
) -> Tokenizer:
    merges_value = metadata.get("tokenizer.ggml.merges")
    if isinstance(merges_value, list) and merges_value:
        merges = [_merge_pair(str(m)) for m in merges_value]
    else:
        scores = metadata.get("tokenizer.ggml.scores")
        if not isinstance(scores, list):
            raise TokenizerLoadError(path, "SentencePiece GGUF has neither merges nor scores")
        numbers = [float(s) for s in scores if isinstance(s, (int, float))]
        merges = _sentencepiece_merges(tokens, numbers)
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    backend = Tokenizer(
        BPE(vocab=_vocab(tokens), merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    prefix_space = metadata.get("tokenizer.ggml.add_space_prefix", True) is not False
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix_space else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _add_special_tokens(
    backend: Tokenizer, metadata: dict[str, MetadataValue], tokens: list[str]
) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens.

    Without this they would be cut into pieces by the BPE. A token is only added when it already
    has its own id, so the vocabulary size never grows past the model's embedding table.
    """
    types = metadata.get("tokenizer.ggml.token_type")
    if not isinstance(types, list):
        return
    vocab = _vocab(tokens)
    special: list[AddedToken] = []
    plain: list[AddedToken] = []
    for index, (token, token_type) in enumerate(zip(tokens, types, strict=False)):
        if vocab.get(token) != index or not token:
            continue
        if token_type in (_CONTROL, _UNKNOWN):
            special.append(AddedToken(token, special=True, normalized=False))
        elif token_type == _USER_DEFINED:
            plain.append(AddedToken(token, special=False, normalized=False))
    backend.add_special_tokens(special)
    backend.add_tokens(plain)


def _set_post_processor(
    backend: Tokenizer, metadata: dict[str, MetadataValue], tokens: list[str], default_bos: bool
) -> None:
    """What `encode(..., add_special_tokens=True)` adds: BOS/EOS as the file's flags say."""

    def wanted(flag: str, key: str, default: bool) -> int | None:
        add = metadata.get(f"tokenizer.ggml.add_{flag}_token", default) is True
        return _token_id(metadata, f"tokenizer.ggml.{key}_token_id", len(tokens)) if add else None

    bos_id, eos_id = wanted("bos", "bos", default_bos), wanted("eos", "eos", False)
    if bos_id is None and eos_id is None:
        return
    bos = [tokens[bos_id]] if bos_id is not None else []
    eos = [tokens[eos_id]] if eos_id is not None else []
    ids = [i for i in (bos_id, eos_id) if i is not None]
    backend.post_processor = processors.TemplateProcessing(
        single=" ".join([*bos, "$A", *eos]),
        pair=" ".join([*bos, "$A", *eos, *bos, "$B", *eos]),
        special_tokens=[(tokens[i], i) for i in dict.fromkeys(ids)],
    )
