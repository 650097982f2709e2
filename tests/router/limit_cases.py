"""Bodies one over (and exactly at) each cap of operator/router/limits.py, built from the table
itself: a cap added without a case here fails `test_every_cap_has_a_case`."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gearshift.operator.router.limits import (
    DETOKENIZE_CAPS,
    GRPC_CAPS,
    HTTP_CAPS,
    Cap,
    Measure,
    RequestLimits,
)
from gearshift.v1 import common_pb2, router_pb2

LIMITS = RequestLimits()
CHAT = [{"role": "user", "content": "hi"}]


def _tool(i: int) -> dict[str, Any]:
    return {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}}


def _schema(size: int) -> dict[str, Any]:
    """A JSON schema whose compact JSON has exactly `size` characters."""
    base = {"type": "string", "description": ""}
    pad = size - len(json.dumps(base))
    return {"type": "string", "description": "d" * pad}


# For each field path: how to build a value of n items (COUNT) or n characters (EACH, JSON).
_COUNT: dict[str, Callable[[int], Any]] = {
    "messages": lambda n: [{"role": "user", "content": "a"}] * n,
    "tools": lambda n: [_tool(i) for i in range(n)],
    "stop": lambda n: [f"s{i}" for i in range(n)],
    "stop_token_ids": lambda n: list(range(1, n + 1)),
    "allowed_token_ids": lambda n: list(range(1, n + 1)),
    "bad_words": lambda n: [f"w{i}" for i in range(n)],
    "logit_bias": lambda n: {str(i): 1.0 for i in range(1, n + 1)},
    "chat_template_kwargs": lambda n: {f"k{i}": 1 for i in range(n)},
    "guided_choice": lambda n: [f"c{i}" for i in range(n)],
    "structured_outputs.choice": lambda n: [f"c{i}" for i in range(n)],
    "tokens": lambda n: [1] * n,
}
_EACH: dict[str, Callable[[int], Any]] = {
    "stop": lambda n: ["s" * n],
    "bad_words": lambda n: ["w" * n],
    "guided_regex": lambda n: "a" * n,
    "structured_outputs.regex": lambda n: "a" * n,
    "guided_grammar": lambda n: 'start: "' + "a" * (n - 9) + '"',
    "structured_outputs.grammar": lambda n: 'start: "' + "a" * (n - 9) + '"',
    "guided_choice": lambda n: ["c" * n],
    "structured_outputs.choice": lambda n: ["c" * n],
}
_JSON: dict[str, Callable[[int], Any]] = {
    "guided_json": _schema,
    "structured_outputs.json": _schema,
    "response_format.json_schema.schema": _schema,
}
_BUILDERS = {Measure.COUNT: _COUNT, Measure.EACH: _EACH, Measure.JSON: _JSON}


def _nest(path: str, value: Any) -> dict[str, Any]:
    keys = path.split(".")
    out: dict[str, Any] = {keys[-1]: value}
    for key in reversed(keys[:-1]):
        out = {key: out}
    if path.startswith("response_format"):
        out["response_format"]["type"] = "json_schema"
        out["response_format"]["json_schema"]["name"] = "x"
    return out


@dataclass(frozen=True)
class Case:
    """One cap: the route, and bodies at and one over its limit."""

    cap: Cap
    route: str
    at: dict[str, Any]
    over: dict[str, Any]

    @property
    def id(self) -> str:
        return f"{self.cap.path}-{self.cap.measure.name.lower()}"


def http_cases() -> list[Case]:
    out = []
    for cap in (*HTTP_CAPS, *DETOKENIZE_CAPS):
        limit = int(getattr(LIMITS, cap.limit))
        build = _BUILDERS[cap.measure][cap.path]
        if cap.path == "tokens":
            route, base = "/detokenize", {}
        elif cap.path in ("messages", "tools", "chat_template_kwargs"):
            route, base = "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}
        else:
            route, base = "/v1/completions", {"prompt": "hi", "max_tokens": 2}
        at, over = _nest(cap.path, build(limit)), _nest(cap.path, build(limit + 1))
        out.append(Case(cap, route, {**base, **at}, {**base, **over}))
    return out


def _sampling(cap: Cap, n: int) -> common_pb2.SamplingParams:
    s = common_pb2.SamplingParams()
    name = cap.path.removeprefix("sampling.")
    if name == "stop":
        s.stop.extend([f"s{i}" for i in range(n)] if cap.measure is Measure.COUNT else ["s" * n])
    elif name in ("stop_token_ids", "allowed_token_ids"):
        getattr(s, name).extend(range(1, n + 1))
    elif name == "bad_words":
        words = [[i + 1] for i in range(n)] if cap.measure is Measure.COUNT else [[5] * n]
        for w in words:
            s.bad_words.add(token_ids=w)
    elif name == "logit_bias":
        s.logit_bias.update({i: 1.0 for i in range(1, n + 1)})
    elif name == "structured.choice":
        choices = [f"c{i}" for i in range(n)] if cap.measure is Measure.COUNT else ["c" * n]
        s.structured.choice.choices.extend(choices)
    elif name == "structured.grammar":
        s.structured.grammar = 'start: "' + "a" * (n - 9) + '"'
    elif name in ("structured.regex", "structured.json_schema"):
        value = "a" * n if name.endswith("regex") else json.dumps(_schema(n))
        setattr(s.structured, name.removeprefix("structured."), value)
    else:
        raise AssertionError(f"no gRPC case for {cap.path}")
    return s


@dataclass(frozen=True)
class GrpcCase:
    cap: Cap
    at: router_pb2.GenerateRequest
    over: router_pb2.GenerateRequest

    @property
    def id(self) -> str:
        return f"{self.cap.path}-{self.cap.measure.name.lower()}"


def grpc_cases() -> list[GrpcCase]:
    out = []
    for cap in GRPC_CAPS:
        limit = int(getattr(LIMITS, cap.limit))

        def request(n: int, cap: Cap = cap) -> router_pb2.GenerateRequest:
            if cap.path == "prompt_token_ids":
                return router_pb2.GenerateRequest(prompt_token_ids=[1] * n)
            return router_pb2.GenerateRequest(prompt="hi", sampling=_sampling(cap, n))

        out.append(GrpcCase(cap, request(limit), request(limit + 1)))
    return out
