"""Tool calling: what `tool_choice` asks of the output, and tool calls parsed out of the text.

`required` and a named function are enforced with structured outputs (vLLM does the same): a
named call's output is its arguments object, `required`'s is a JSON array of {name, parameters}.
With `auto` the model decides; its text is parsed in the Hermes/Qwen format
(`<tool_call>{"name": …, "arguments": …}</tool_call>`) or Llama 3's JSON
(`{"name": …, "parameters": …}`, optionally after `<|python_tag|>`, several joined by `;`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from gearshift.operator.router import errors
from gearshift.operator.router.protocol import SamplingFields
from gearshift.worker.structured.grammar import GrammarSpec

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
# What a tool call's text starts with, in the formats we parse.
_MARKERS = ("<tool_call>", _PYTHON_TAG, "{", "[")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_dict(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out["index"] = index
        return out


@dataclass(frozen=True)
class ToolPlan:
    """How this chat request's output becomes tool calls."""

    mode: str  # "auto", "required" or "named"
    names: tuple[str, ...]
    grammar: GrammarSpec | None = None
    named: str | None = None
    parallel: bool = True


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for index, tool in enumerate(tools):
        fn = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise errors.bad_request(f"tools[{index}] must be a function tool", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise errors.bad_request(f"tools[{index}].function.name is required", "tools")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise errors.bad_request(
                f"tools[{index}].function.parameters must be an object", "tools"
            )
        out[name] = params
    return out


def tool_plan(body: SamplingFields) -> ToolPlan | None:
    """None when no tool call can come out (no tools, or tool_choice none)."""
    tools: list[dict[str, Any]] | None = getattr(body, "tools", None)
    choice: Any = getattr(body, "tool_choice", None)
    parallel = bool(getattr(body, "parallel_tool_calls", True))
    if not tools:
        if choice not in (None, "none"):
            raise errors.bad_request("tool_choice needs tools", "tool_choice")
        return None
    functions = _functions(tools)
    names = tuple(functions)
    if choice == "none":
        return None
    if choice is None or choice == "auto":
        return ToolPlan("auto", names, parallel=parallel)
    if choice == "required":
        items = [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [n]}, "parameters": p},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for n, p in functions.items()
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not parallel:
            schema["maxItems"] = 1
        return ToolPlan("required", names, GrammarSpec("json_schema", json.dumps(schema)))
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or choice.get("type", "function") != "function":
        raise errors.bad_request(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if name not in functions:
        raise errors.bad_request(
            f"tool_choice names {name[:64]!r}, which is not in tools", "tool_choice"
        )
    spec = GrammarSpec("json_schema", json.dumps(functions[name]))
    return ToolPlan("named", names, spec, named=name)


def _call(obj: Any, names: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        return ToolCall(obj["name"], args)
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_tool_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content left over, tool calls) of one finished output; no calls: the text as content."""
    if plan.mode == "named":
        assert plan.named is not None
        return None, [ToolCall(plan.named, text.strip())]
    if plan.mode == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return text, []
        if not isinstance(items, list):
            return text, []
        forced = [c for c in (_call(i, plan.names) for i in items) if c is not None]
        return (None, forced) if forced else (text, [])
    calls: list[ToolCall] = []
    content: str | None = text
    if "<tool_call>" in text:
        content = text[: text.index("<tool_call>")].strip() or None
        for body in _HERMES.findall(text):
            try:
                call = _call(json.loads(body), plan.names)
            except ValueError:
                call = None
            if call is not None:
                calls.append(call)
    else:
        stripped = text.strip().removeprefix(_PYTHON_TAG).strip()
        if stripped.startswith("{"):
            for part in _split_json_objects(stripped):
                call = _call(part, plan.names)
                if call is not None:
                    calls.append(call)
            content = None if calls else text
    if not calls:
        return text, []
    if not plan.parallel:
        calls = calls[:1]
    return content, calls


def _split_json_objects(text: str) -> list[Any]:
    """Llama 3 writes several calls as JSON objects joined by ';' (or just whitespace)."""
    decoder = json.JSONDecoder()
    out: list[Any] = []
    pos = 0
    while pos < len(text):
        try:
            obj, end = decoder.raw_decode(text, pos)
        except ValueError:
            return []  # not all JSON: not tool calls
        out.append(obj)
        pos = end
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
    return out


def may_be_tool_call(text: str) -> bool:
    """Whether streamed text so far could still turn out to be a tool call (then it is held)."""
    head = text.lstrip()
    return any(head.startswith(m) or m.startswith(head) for m in _MARKERS)
