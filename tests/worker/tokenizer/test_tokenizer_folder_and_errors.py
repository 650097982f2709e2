"""Loading from a Hugging Face folder, typed load errors, and chat template errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gearshift.worker.tokenizer import (
    ChatTemplate,
    ChatTemplateError,
    Tokenizer,
    TokenizerLoadError,
)

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture()
def hf_folder(tmp_path: Path, smollm_tokenizer: Tokenizer) -> Path:
    """A Hugging Face style folder holding SmolLM2's tokenizer as tokenizer.json."""
    smollm_tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>", "special": True},
        "chat_template": TEMPLATE,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return tmp_path


def test_folder_tokenizer_reads_config_and_generation_eos(
    hf_folder: Path, smollm_tokenizer: Tokenizer
) -> None:
    tok = Tokenizer.from_path(hf_folder)
    assert tok.eos_token_ids == frozenset({0, 2})
    assert tok.bos_token_id == 1
    assert tok.vocab_size == smollm_tokenizer.vocab_size
    text = "Héllo 世界 🎉 2024"
    assert tok.encode(text) == smollm_tokenizer.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template_text(messages) == "<|im_start|>user\nhi<|im_end|>\n" + (
        "<|im_start|>assistant\n"
    )


def test_tokenizer_json_path_loads_its_folder(hf_folder: Path) -> None:
    assert Tokenizer.from_path(hf_folder / "tokenizer.json").eos_token_ids == {0, 2}


def test_chat_template_jinja_file_takes_precedence(hf_folder: Path) -> None:
    (hf_folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    tok = Tokenizer.from_path(hf_folder)
    assert tok.apply_chat_template_text([{"role": "user", "content": "hey"}]) == "hey!"


def test_folder_with_only_a_gguf_loads_it(tmp_path: Path, sentencepiece_gguf: Path) -> None:
    (tmp_path / "model.gguf").write_bytes(sentencepiece_gguf.read_bytes())
    assert Tokenizer.from_path(tmp_path).encode("hello") == [1, 280]


def test_missing_path_raises_load_error_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(TokenizerLoadError, match="no-such-model") as info:
        Tokenizer.from_path(missing)
    assert info.value.path == str(missing)


def test_folder_without_tokenizer_files_raises_load_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerLoadError, match=r"no tokenizer\.json") as info:
        Tokenizer.from_path(tmp_path)
    assert info.value.path == str(tmp_path)


def test_corrupt_files_raise_load_error_naming_the_file(tmp_path: Path, hf_folder: Path) -> None:
    (hf_folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerLoadError, match=r"tokenizer_config\.json"):
        Tokenizer.from_path(hf_folder)
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"GGUF\x03\x00\x00\x00")  # header cut short
    with pytest.raises(TokenizerLoadError, match=r"fake\.gguf"):
        Tokenizer.from_path(fake)
    not_gguf = tmp_path / "other.gguf"
    not_gguf.write_bytes(b"\x00" * 64)
    with pytest.raises(TokenizerLoadError, match="bad magic"):
        Tokenizer.from_path(not_gguf)


MALFORMED: list[tuple[Any, str]] = [
    ([], "must not be empty"),
    ("hello", "must be a list"),
    ([{"content": "hi"}], r"messages\[0\].role"),
    ([{"role": "", "content": "hi"}], r"messages\[0\].role"),
    ([{"role": "user"}], r"messages\[0\].content is missing"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": 3}], r"messages\[1\].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], "only text parts"),
    (["not a message"], r"messages\[0\] must be an object"),
]


@pytest.mark.parametrize(("messages", "reason"), MALFORMED)
def test_malformed_messages_raise_chat_template_error(
    smollm_tokenizer: Tokenizer, messages: Any, reason: str
) -> None:
    with pytest.raises(ChatTemplateError, match=reason):
        smollm_tokenizer.apply_chat_template(messages)


def test_text_parts_are_joined_and_tool_call_turns_need_no_content(
    smollm_tokenizer: Tokenizer,
) -> None:
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    text = smollm_tokenizer.apply_chat_template_text([{"role": "user", "content": parts}])
    assert "one\ntwo" in text
    tool_turn = {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}
    counting = ChatTemplate("{{ messages | length }}")
    assert counting.render([{"role": "user", "content": "call it"}, tool_turn]) == "2"


def test_template_raise_exception_becomes_chat_template_error(hf_folder: Path) -> None:
    (hf_folder / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first turn must be user') }}"
        "{% endif %}ok"
    )
    tok = Tokenizer.from_path(hf_folder)
    assert tok.apply_chat_template_text([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="first turn must be user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_broken_template_syntax_becomes_chat_template_error(hf_folder: Path) -> None:
    (hf_folder / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        Tokenizer.from_path(hf_folder).apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_chat_template_raises_chat_template_error(
    sentencepiece_tokenizer: Tokenizer,
) -> None:
    assert not sentencepiece_tokenizer.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        sentencepiece_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
