"""What one request may ask of the router: the size caps of every body, list and string field.

One table (`RequestLimits`, its defaults documented in docs/serving.md "Limits") bounds the CPU
and memory one request can cost before any of it is spent: the body's bytes and JSON nesting,
and each list or string whose cost grows with its size (stop strings are matched on every
output token of every sequence, token-id lists become tensors on every worker step, grammars
are compiled). Each cap is checked on the parsed JSON, before validation or tokenisation, and
refused with a 400 naming the field and the limit; the gRPC twin checks the same caps on
`GenerateRequest`. The defaults are above what vLLM clients ordinarily send.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from gearshift.operator.router import errors
from gearshift.v1 import common_pb2


@dataclass(frozen=True)
class RequestLimits:
    """The caps; only the body size is a setting (--max-body-bytes, router.json maxBodyBytes)."""

    # 4 MiB holds a 1M-token prompt of English text, or a 128k-token one in any script even
    # with every character \u-escaped (6 bytes); a larger body is refused with 413.
    max_body_bytes: int = 4 << 20
    max_json_depth: int = 64  # nested arrays and objects (JSON schemas nest a few levels each)
    max_token_ids: int = 1 << 20  # per prompt of token ids, /detokenize's tokens
    max_messages: int = 2048
    max_tools: int = 128  # OpenAI's documented bound
    max_tool_chars: int = 64 << 10  # each tool's JSON
    max_stop: int = 32  # matched on every output token of every sequence
    max_stop_chars: int = 256
    max_stop_token_ids: int = 1024
    max_allowed_token_ids: int = 8192  # rebuilt as a mask on every worker step
    max_bad_words: int = 256
    max_bad_word_chars: int = 256  # gRPC: token ids per word
    max_logit_bias: int = 1024
    max_regex_chars: int = 16 << 10
    max_grammar_chars: int = 64 << 10
    max_json_schema_chars: int = 64 << 10
    max_choices: int = 1024
    max_choice_chars: int = 1024
    max_template_kwargs: int = 64
    max_unknown_fields: int = 64  # fields neither we nor vLLM know, accepted and ignored
    # Token ids of stop_token_ids, allowed_token_ids, logit_bias and (tokenised) bad_words,
    # times the request's sequences: each sequence is a worker call carrying all of them,
    # serialised on the event loop.
    max_sampling_token_ids: int = 64 << 10


class Measure(Enum):
    """What a cap counts."""

    COUNT = "entries"  # a list's items or an object's keys
    EACH = "characters"  # a string, or each string of a list (gRPC: token ids per entry)
    JSON = "characters of JSON"  # a string, or an object's compact JSON


@dataclass(frozen=True)
class Cap:
    """One row of the table: the field's dotted path, what is measured, the limit's name."""

    path: str
    measure: Measure
    limit: str  # a RequestLimits attribute
    unit: str = ""  # overrides the measure's unit in messages and docs

    def unit_name(self) -> str:
        return self.unit or self.measure.value


_REGEX = ("guided_regex", "structured_outputs.regex")
_GRAMMAR = ("guided_grammar", "structured_outputs.grammar")
_JSON = ("guided_json", "structured_outputs.json", "response_format.json_schema.schema")
_CHOICE = ("guided_choice", "structured_outputs.choice")

# The caps of /v1/completions, /v1/chat/completions and /tokenize bodies (prompt token ids are
# checked by `check_prompt_ids`: a prompt is a string, token ids or a list of either).
HTTP_CAPS: tuple[Cap, ...] = (
    Cap("messages", Measure.COUNT, "max_messages", "messages"),
    Cap("tools", Measure.COUNT, "max_tools", "tools"),
    Cap("stop", Measure.COUNT, "max_stop", "stop strings"),
    Cap("stop", Measure.EACH, "max_stop_chars"),
    Cap("stop_token_ids", Measure.COUNT, "max_stop_token_ids", "token ids"),
    Cap("allowed_token_ids", Measure.COUNT, "max_allowed_token_ids", "token ids"),
    Cap("bad_words", Measure.COUNT, "max_bad_words", "words"),
    Cap("bad_words", Measure.EACH, "max_bad_word_chars"),
    Cap("logit_bias", Measure.COUNT, "max_logit_bias", "entries"),
    Cap("chat_template_kwargs", Measure.COUNT, "max_template_kwargs", "keys"),
    *(Cap(p, Measure.EACH, "max_regex_chars") for p in _REGEX),
    *(Cap(p, Measure.EACH, "max_grammar_chars") for p in _GRAMMAR),
    *(Cap(p, Measure.JSON, "max_json_schema_chars") for p in _JSON),
    *(Cap(p, Measure.COUNT, "max_choices", "choices") for p in _CHOICE),
    *(Cap(p, Measure.EACH, "max_choice_chars") for p in _CHOICE),
)
DETOKENIZE_CAPS: tuple[Cap, ...] = (Cap("tokens", Measure.COUNT, "max_token_ids", "token ids"),)
# gRPC Generate, over the view `generate_view` builds of a GenerateRequest.
GRPC_CAPS: tuple[Cap, ...] = (
    Cap("prompt_token_ids", Measure.COUNT, "max_token_ids", "token ids"),
    Cap("sampling.stop", Measure.COUNT, "max_stop", "stop strings"),
    Cap("sampling.stop", Measure.EACH, "max_stop_chars"),
    Cap("sampling.stop_token_ids", Measure.COUNT, "max_stop_token_ids", "token ids"),
    Cap("sampling.allowed_token_ids", Measure.COUNT, "max_allowed_token_ids", "token ids"),
    Cap("sampling.bad_words", Measure.COUNT, "max_bad_words", "words"),
    Cap("sampling.bad_words", Measure.EACH, "max_bad_word_chars", "token ids"),
    Cap("sampling.logit_bias", Measure.COUNT, "max_logit_bias", "entries"),
    Cap("sampling.structured.regex", Measure.EACH, "max_regex_chars"),
    Cap("sampling.structured.grammar", Measure.EACH, "max_grammar_chars"),
    Cap("sampling.structured.json_schema", Measure.EACH, "max_json_schema_chars"),
    Cap("sampling.structured.choice", Measure.COUNT, "max_choices", "choices"),
    Cap("sampling.structured.choice", Measure.EACH, "max_choice_chars"),
)


def _lookup(body: Mapping[str, Any], path: str) -> Any:
    value: Any = body
    for key in path.split("."):
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return value


def _too_big(cap: Cap, limit: int, got: int, where: str) -> errors.APIError:
    param = cap.path.split(".")[0]
    return errors.bad_request(
        f"{where}: at most {limit} {cap.unit_name()} allowed, got {got}", param, "limit_exceeded"
    )


def check(body: Mapping[str, Any], caps: Iterable[Cap], limits: RequestLimits) -> None:
    """Refuse the first field of `body` over its cap (fields of another type are left to the
    body's validation, which names them)."""
    for cap in caps:
        value = _lookup(body, cap.path)
        if value is None:
            continue
        limit = int(getattr(limits, cap.limit))
        if cap.measure is Measure.COUNT:
            if isinstance(value, (list, tuple, Mapping)) and len(value) > limit:
                raise _too_big(cap, limit, len(value), cap.path)
        elif cap.measure is Measure.JSON:
            size = len(value) if isinstance(value, str) else len(json.dumps(value))
            if size > limit:
                raise _too_big(cap, limit, size, cap.path)
        else:
            items = [value] if isinstance(value, str) else value
            if not isinstance(items, (list, tuple)):
                continue
            for i, item in enumerate(items):
                if isinstance(item, (str, list, tuple)) and len(item) > limit:
                    where = cap.path if item is value else f"{cap.path}[{i}]"
                    raise _too_big(cap, limit, len(item), where)


def check_prompt_ids(prompt: Any, limits: RequestLimits) -> None:
    """A prompt of token ids (or each of a list of them) has at most max_token_ids."""
    if not isinstance(prompt, list) or not prompt:
        return
    lists = prompt if isinstance(prompt[0], list) else [prompt]
    for i, ids in enumerate(lists):
        if isinstance(ids, list) and len(ids) > limits.max_token_ids:
            where = "prompt" if ids is prompt else f"prompt[{i}]"
            cap = Cap("prompt", Measure.COUNT, "max_token_ids", "token ids")
            raise _too_big(cap, limits.max_token_ids, len(ids), where)


def check_tools(tools: Any, limits: RequestLimits) -> None:
    """Each tool's JSON (its schema, mostly) has at most max_tool_chars characters."""
    if not isinstance(tools, list):
        return
    for i, tool in enumerate(tools):
        size = len(json.dumps(tool))
        if size > limits.max_tool_chars:
            cap = Cap("tools", Measure.JSON, "max_tool_chars")
            raise _too_big(cap, limits.max_tool_chars, size, f"tools[{i}]")


def check_unknown(body: Mapping[str, Any], known: frozenset[str], limits: RequestLimits) -> None:
    """At most max_unknown_fields fields that neither we nor vLLM know (each is logged once)."""
    unknown = sum(1 for key in body if key not in known)
    if unknown > limits.max_unknown_fields:
        raise errors.bad_request(
            f"at most {limits.max_unknown_fields} unknown fields allowed, got {unknown}",
            None,
            "limit_exceeded",
        )


def check_generation(body: Mapping[str, Any], known: frozenset[str], limits: RequestLimits) -> None:
    """Every cap of a completions, chat or /tokenize body."""
    check(body, HTTP_CAPS, limits)
    check_prompt_ids(body.get("prompt"), limits)
    check_tools(body.get("tools"), limits)
    check_unknown(body, known, limits)


def check_sampling_total(
    sampling: common_pb2.SamplingParams, sequences: int, limits: RequestLimits
) -> None:
    """The sampling lists of all the request's sequences, together, within their cap."""
    ids = (
        len(sampling.stop_token_ids)
        + len(sampling.allowed_token_ids)
        + len(sampling.logit_bias)
        + sum(len(w.token_ids) for w in sampling.bad_words)
    )
    if ids * sequences > limits.max_sampling_token_ids:
        raise errors.bad_request(
            f"n: {sequences} sequences × {ids} token ids of stop_token_ids, allowed_token_ids, "
            f"logit_bias and bad_words (tokenised) must be at most "
            f"{limits.max_sampling_token_ids}, got {ids * sequences}",
            "n",
            "limit_exceeded",
        )


def table_rows(limits: RequestLimits | None = None) -> list[tuple[str, str]]:
    """(field, cap) rows of the docs' table, from the caps above (a test compares the docs)."""
    limits = limits or RequestLimits()
    caps = (*HTTP_CAPS, *DETOKENIZE_CAPS, *GRPC_CAPS)
    counted = {cap.path for cap in caps if cap.measure is Measure.COUNT}
    rows: dict[str, list[str]] = {}
    for cap in caps:
        text = f"{getattr(limits, cap.limit):,} {cap.unit_name()}"
        if cap.measure is Measure.EACH and cap.path in counted:
            text += " each"
        rows.setdefault(f"`{cap.path}`", []).append(text)
    return [(field, ", ".join(texts)) for field, texts in rows.items()]
