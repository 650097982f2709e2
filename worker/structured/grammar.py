"""What a structured output must match, and its llguidance grammar (torch-free: the router
validates specs with this module before any worker sees them).

llguidance compiles JSON schemas, regular expressions and Lark grammars into one matcher type
whose token masks cost microseconds per step, on CPU, with no torch dependency (docs/serving.md
says why it was chosen over xgrammar and outlines-core).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from llguidance import LLMatcher
from llguidance.gbnf_to_lark import any_to_lark

from gearshift.v1 import common_pb2

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[Kind, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")
# OpenAI's json_object mode: any JSON object.
_ANY_OBJECT = '{"type": "object"}'
# One space after ':' and ',' and no other whitespace: the layout models were trained on, and
# no room for a sampler to wander into endless newlines (llguidance allows any by default).
_JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class InvalidGrammar(ValueError):
    """A structured-output spec that cannot be compiled; the message says why."""


@dataclass(frozen=True)
class GrammarSpec:
    """One structured-output constraint: its kind and its text (schema JSON, regex, grammar)."""

    kind: Kind
    value: str = ""
    choices: tuple[str, ...] = ()


@lru_cache(maxsize=256)
def compile_grammar(spec: GrammarSpec) -> str:
    """The llguidance grammar of `spec`; raises InvalidGrammar with the compiler's message.

    Remembered per spec (a failure is not): the n choices of one request, and clients that send
    the same schema on every request, translate and validate it once.
    """
    try:
        if spec.kind == "json_object":
            grammar = LLMatcher.grammar_from_json_schema(_ANY_OBJECT, _JSON_OPTIONS)
        elif spec.kind == "json_schema":
            grammar = LLMatcher.grammar_from_json_schema(spec.value, _JSON_OPTIONS)
        elif spec.kind == "regex":
            grammar = LLMatcher.grammar_from_regex(spec.value)
        elif spec.kind == "choice":
            if not spec.choices:
                raise InvalidGrammar("choice needs at least one string")
            lark = "start: " + " | ".join(json.dumps(c) for c in spec.choices)
            grammar = LLMatcher.grammar_from_lark(lark)
        else:
            grammar = LLMatcher.grammar_from_lark(_to_lark(spec.value))
    except ValueError as exc:  # llguidance: the schema is not valid JSON
        raise InvalidGrammar(str(exc)) from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidGrammar(error.strip().splitlines()[0])
    return grammar


def _to_lark(text: str) -> str:
    # vLLM's guided_grammar takes GBNF (llama.cpp) or Lark; llguidance converts GBNF to Lark.
    try:
        return str(any_to_lark(text))
    except Exception as exc:  # noqa: BLE001 - the converter raises bare exceptions
        raise InvalidGrammar(f"cannot parse the grammar: {exc}") from None


def spec_to_proto(spec: GrammarSpec) -> common_pb2.StructuredOutput:
    out = common_pb2.StructuredOutput()
    if spec.kind == "json_object":
        out.json_object = True
    elif spec.kind == "choice":
        out.choice.choices.extend(spec.choices)
    else:
        setattr(out, spec.kind, spec.value)
    return out


def spec_from_proto(msg: common_pb2.StructuredOutput) -> GrammarSpec | None:
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "choice":
        return GrammarSpec("choice", choices=tuple(msg.choice.choices))
    value = getattr(msg, kind)
    assert kind in KINDS
    return GrammarSpec(kind, str(value))
