"""Which structured output a request asks for: response_format, vLLM's structured_outputs and
guided_* fields, or a tool_choice that forces a call; at most one, compiled once to answer 400."""

from __future__ import annotations

import json

from gearshift.operator.router import errors
from gearshift.operator.router.protocol import ChatCompletionRequest, SamplingFields
from gearshift.operator.router.tool_calls import ToolPlan, tool_plan
from gearshift.worker.structured.grammar import GrammarSpec, InvalidGrammar, compile_grammar

# Backends a client may name: we have one, llguidance ("guidance" is vLLM's name for it).
_BACKENDS = {"auto", "guidance", "llguidance"}


def _json_text(value: str | dict[str, object], param: str) -> str:
    if isinstance(value, str):
        try:
            json.loads(value)
        except ValueError as exc:
            raise errors.bad_request(f"{param} is not valid JSON: {exc}", param) from None
        return value
    return json.dumps(value)


def _requested_specs(body: SamplingFields) -> list[tuple[str, GrammarSpec]]:
    """Every structured-output constraint the body asks for, with the field that asked."""
    specs: list[tuple[str, GrammarSpec]] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        specs.append(("response_format", GrammarSpec("json_object")))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise errors.bad_request(
                "response_format.json_schema.schema is required", "response_format"
            )
        specs.append(
            ("response_format", GrammarSpec("json_schema", json.dumps(rf.json_schema.schema_)))
        )
    so = body.structured_outputs
    if so is not None:
        set_fields = [
            k for k in ("json_", "regex", "choice", "grammar", "json_object") if getattr(so, k)
        ]
        if len(set_fields) != 1:
            raise errors.bad_request(
                "structured_outputs must set exactly one of json, regex, choice, grammar, "
                "json_object",
                "structured_outputs",
            )
        kind = set_fields[0]
        if kind == "json_":
            assert so.json_ is not None
            spec = GrammarSpec("json_schema", _json_text(so.json_, "structured_outputs.json"))
        elif kind == "choice":
            spec = GrammarSpec("choice", choices=tuple(so.choice or ()))
        elif kind == "json_object":
            spec = GrammarSpec("json_object")
        else:
            spec = GrammarSpec(kind, str(getattr(so, kind)))  # type: ignore[arg-type]
        specs.append(("structured_outputs", spec))
    if body.guided_json is not None:
        specs.append(
            ("guided_json", GrammarSpec("json_schema", _json_text(body.guided_json, "guided_json")))
        )
    if body.guided_regex is not None:
        specs.append(("guided_regex", GrammarSpec("regex", body.guided_regex)))
    if body.guided_choice is not None:
        specs.append(("guided_choice", GrammarSpec("choice", choices=tuple(body.guided_choice))))
    if body.guided_grammar is not None:
        specs.append(("guided_grammar", GrammarSpec("grammar", body.guided_grammar)))
    return specs


def structured_spec(body: SamplingFields) -> tuple[GrammarSpec | None, ToolPlan | None]:
    """The one grammar the output must match (None: free text) and the chat's tool plan."""
    backend = body.guided_decoding_backend
    if backend is not None and backend not in _BACKENDS:
        raise errors.bad_request(
            f"guided_decoding_backend {backend[:40]!r} is not available; this server uses "
            "llguidance ('auto', 'guidance')",
            "guided_decoding_backend",
        )
    specs = _requested_specs(body)
    plan = tool_plan(body) if isinstance(body, ChatCompletionRequest) else None
    if plan is not None and plan.grammar is not None:
        specs.append(("tool_choice", plan.grammar))
    if len(specs) > 1:
        names = ", ".join(name for name, _ in specs)
        raise errors.bad_request(
            f"only one structured-output constraint may be set, got {names}", specs[1][0]
        )
    if not specs:
        return None, plan
    param, spec = specs[0]
    try:
        compile_grammar(spec)  # the worker compiles again; this answers 400 before routing
    except InvalidGrammar as exc:
        raise errors.bad_request(f"{param}: {str(exc)[:500]}", param) from None
    return spec, plan
