"""`Tokenizer`: encode, decode and chat templates over a Hugging Face fast tokenizer.

Built on the `tokenizers` library alone, never `transformers`: transformers imports torch, and the
router process that tokenises requests must stay free of it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from gearshift.worker.tokenizer.chat_template import ChatTemplate, Message
from gearshift.worker.tokenizer.errors import ChatTemplateError, TokenizerLoadError
from gearshift.worker.tokenizer.gguf_metadata import read_gguf_metadata
from gearshift.worker.tokenizer.gguf_vocab import build_gguf_tokenizer

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclass(frozen=True, eq=False)
class Tokenizer:
    """A loaded tokenizer: its backend, end-of-sequence ids and optional chat template."""

    backend: Backend
    bos_token_id: int | None
    eos_token_ids: frozenset[int]
    chat_template: ChatTemplate | None
    source: str = "<memory>"

    @classmethod
    def from_path(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load from a model folder (tokenizer.json and friends) or a `.gguf` file."""
        resolved = Path(path)
        if not resolved.exists():
            raise TokenizerLoadError(resolved, "the path does not exist")
        if resolved.is_file():
            if resolved.suffix == ".gguf":
                return cls._from_gguf(resolved)
            if resolved.name == "tokenizer.json":
                return cls._from_folder(resolved.parent)
            raise TokenizerLoadError(
                resolved, "expected a folder, a tokenizer.json or a .gguf file"
            )
        if (resolved / "tokenizer.json").is_file():
            return cls._from_folder(resolved)
        ggufs = sorted(resolved.glob("*.gguf"))
        if len(ggufs) == 1:
            return cls._from_gguf(ggufs[0])
        if ggufs:
            names = ", ".join(p.name for p in ggufs)
            raise TokenizerLoadError(resolved, f"several .gguf files, name one of: {names}")
        raise TokenizerLoadError(resolved, "the folder has no tokenizer.json and no .gguf file")

    @classmethod
    def _from_gguf(cls, path: Path) -> Tokenizer:
        built = build_gguf_tokenizer(path, read_gguf_metadata(path))
        template = built.chat_template
        return cls(
            backend=built.backend,
            bos_token_id=built.bos_token_id,
            eos_token_ids=frozenset(built.eos_token_ids),
            chat_template=ChatTemplate(template, built.special_tokens) if template else None,
            source=str(path),
        )

    @classmethod
    def _from_folder(cls, folder: Path) -> Tokenizer:
        try:
            backend = Backend.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:  # the Rust side raises a bare Exception on parse errors
            raise TokenizerLoadError(folder / "tokenizer.json", f"cannot parse: {exc}") from exc
        config = _read_json(folder / "tokenizer_config.json")
        generation = _read_json(folder / "generation_config.json")
        special = {name: text for name in _SPECIAL_NAMES if (text := _token_text(config.get(name)))}

        def token_id(name: str) -> int | None:
            text = special.get(name)
            return backend.token_to_id(text) if text is not None else None

        eos_ids = {i for i in (token_id("eos_token"),) if i is not None}
        eos_ids.update(_int_list(generation.get("eos_token_id")))
        bos_id = token_id("bos_token")
        if bos_id is None:
            bos_ids = _int_list(generation.get("bos_token_id"))
            bos_id = bos_ids[0] if bos_ids else None
        template = _folder_chat_template(folder, config)
        return cls(
            backend=backend,
            bos_token_id=bos_id,
            eos_token_ids=frozenset(eos_ids),
            chat_template=ChatTemplate(template, special) if template else None,
            source=str(folder),
        )

    @property
    def eos_token_id(self) -> int | None:
        """The smallest EOS id, for callers that need a single one (e.g. padding)."""
        return min(self.eos_token_ids) if self.eos_token_ids else None

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @cached_property
    def all_special_ids(self) -> frozenset[int]:
        """Ids of the special added tokens: the ones `decode(skip_special_tokens=True)` drops."""
        decoder = self.backend.get_added_tokens_decoder()
        return frozenset(i for i, token in decoder.items() if token.special)

    @property
    def has_chat_template(self) -> bool:
        """Whether `apply_chat_template` can be used."""
        return self.chat_template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds what the model's post-processor adds."""
        # encode_batch releases the GIL while it works (encode holds it): the router tokenises
        # in threads beside its event loop (operator/router/lanes.py). Same ids.
        batch = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(batch[0].ids)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; incomplete UTF-8 sequences come out as U+FFFD."""
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        """The vocabulary strings of `ids` (None for an id outside the vocabulary)."""
        return [self.backend.id_to_token(i) for i in ids]

    def apply_chat_template_text(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The chat prompt as text (special tokens spelled out)."""
        if self.chat_template is None:
            raise ChatTemplateError(f"the tokenizer from {self.source} has no chat template")
        return self.chat_template.render(messages, add_generation_prompt, tools, **template_kwargs)

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """The chat prompt as token ids; the template writes BOS itself, so none is added."""
        text = self.apply_chat_template_text(
            messages, add_generation_prompt, tools, **template_kwargs
        )
        return self.encode(text, add_special_tokens=False)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerLoadError(path, f"invalid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerLoadError(path, "expected a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes a special token as a string or as a serialised AddedToken.
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _int_list(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _folder_chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    """The template, from where transformers looks first: the .jinja file, the .json, the config."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(folder / "chat_template.json").get("chat_template")
    if template is None:
        template = config.get("chat_template")
    if isinstance(template, list):
        # Several named templates: "default" is the one apply_chat_template uses.
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None
