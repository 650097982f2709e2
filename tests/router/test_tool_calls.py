"""Tool calls parsed out of model text (Hermes/Qwen and Llama 3 JSON), and tool_choice plans."""

from __future__ import annotations

import json

import pytest

from gearshift.operator.router.errors import APIError
from gearshift.operator.router.protocol import ChatCompletionRequest
from gearshift.operator.router.tool_calls import may_be_tool_call, parse_tool_calls, tool_plan

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_time"}},
]


def _plan(**kw: object):
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS, **kw}
    )
    plan = tool_plan(body)
    assert plan is not None
    return plan


def test_hermes_tool_calls_are_parsed_with_the_content_before_them() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    content, calls = parse_tool_calls(_plan(), text)
    assert content == "Let me check."
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    assert calls[0].id != calls[1].id


def test_llama3_json_tool_calls_with_python_tag_and_semicolons() -> None:
    text = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
        '{"name": "get_time", "parameters": {"zone": "CET"}}'
    )
    content, calls = parse_tool_calls(_plan(), text)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {"zone": "CET"}),
    ]


@pytest.mark.parametrize(
    "text",
    [
        "Paris is sunny today.",
        '{"name": "unknown_tool", "parameters": {}}',
        "<tool_call>{not json}</tool_call>",
        '{"answer": 42}',
    ],
)
def test_text_that_is_not_a_known_tool_call_stays_content(text: str) -> None:
    assert parse_tool_calls(_plan(), text) == (text, [])


def test_parallel_tool_calls_false_keeps_only_the_first() -> None:
    text = '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {}}'
    _, calls = parse_tool_calls(_plan(parallel_tool_calls=False), text)
    assert [c.name for c in calls] == ["get_time"]


def test_named_and_required_choices_carry_a_json_schema_grammar() -> None:
    named = _plan(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.mode == "named" and named.grammar is not None
    assert parse_tool_calls(named, ' {"zone": "UTC"}')[1][0].arguments == '{"zone": "UTC"}'
    required = _plan(tool_choice="required")
    assert required.grammar is not None
    schema = json.loads(required.grammar.value)
    assert schema["type"] == "array" and schema["minItems"] == 1
    _, calls = parse_tool_calls(required, '[{"name": "get_time", "parameters": {"zone": "X"}}]')
    assert [(c.name, c.arguments) for c in calls] == [("get_time", '{"zone": "X"}')]


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": {"function": "get_time"}}, "tool_choice"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
    ],
)
def test_bad_tool_choices_are_400_naming_the_field(kw: dict, param: str) -> None:
    with pytest.raises(APIError) as info:
        _plan(**kw)
    assert info.value.status == 400 and info.value.param == param


def test_tool_choice_none_parses_nothing_and_streams_hold_only_possible_calls() -> None:
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "tool_choice": "none"}
    )
    assert tool_plan(body) is None
    assert may_be_tool_call("  <tool_") and may_be_tool_call('{"na')
    assert not may_be_tool_call("Hello")
