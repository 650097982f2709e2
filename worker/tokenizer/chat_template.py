"""Render a model's Jinja chat template the way transformers' `apply_chat_template` does."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gearshift.worker.tokenizer.errors import ChatTemplateError

Message = Mapping[str, Any]


class _GenerationTag(Extension):
    """`{% generation %}` marks assistant text for training masks; rendering keeps the body."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's Extension declares it a class attribute

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body", []), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' filter: unlike jinja2's own `tojson` it does not HTML-escape.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _content_text(index: int, content: Any) -> str:
    """OpenAI content is a string or a list of parts; only text parts can reach a text model."""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, bytes):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise ChatTemplateError(f"messages[{index}].content: only text parts are supported")
            text = part.get("text")
            if not isinstance(text, str):
                raise ChatTemplateError(f"messages[{index}].content: a text part has no text")
            texts.append(text)
        # vLLM joins text parts with newlines for string-content templates; clients expect that.
        return "\n".join(texts)
    raise ChatTemplateError(
        f"messages[{index}].content must be a string or a list of text parts, "
        f"got {type(content).__name__}"
    )


def normalize_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Checked copies of `messages`: each has a non-empty string role and string content."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError("messages must be a list of {role, content} objects")
    if not messages:
        raise ChatTemplateError("messages must not be empty")
    normalized = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{index}] must be an object with role and content")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"messages[{index}].role is missing or not a string")
        copy = dict(message)
        content = message.get("content")
        if content is None:
            # An assistant turn that only calls tools legitimately has no content.
            if not (role == "assistant" and message.get("tool_calls")):
                raise ChatTemplateError(f"messages[{index}].content is missing")
        else:
            copy["content"] = _content_text(index, content)
        normalized.append(copy)
    return normalized


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template plus the special-token strings it may reference."""

    source: str
    special_tokens: Mapping[str, str] = field(default_factory=dict)

    @cached_property
    def _compiled(self) -> jinja2.Template:
        # Same environment as transformers, so templates written for it render identically.
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_GenerationTag, "jinja2.ext.loopcontrols"],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            return env.from_string(self.source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from exc

    def render(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text for `messages`; raises ChatTemplateError on malformed input."""
        checked = normalize_messages(messages)
        context = {**self.special_tokens, **template_kwargs}
        try:
            return self._compiled.render(
                messages=checked,
                tools=list(tools) if tools is not None else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except ChatTemplateError:
            raise
        # A template that trips over the request's data is a bad request, not a server fault.
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as exc:
            raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from exc
