"""Streamed chat with tools: text that may be a tool call is held, then sent as tool_calls (or
as content when it was not one); plain text streams at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from gearshift.operator.router import chat_render
from gearshift.operator.router.choices import Choices
from gearshift.operator.router.generate import RunResult, TokenDelta
from gearshift.operator.router.protocol import ChatCompletionRequest
from gearshift.operator.router.tool_calls import tool_plan

TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


def _render(pieces: list[str]) -> list[dict[str, Any]]:
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS}
    )
    view = chat_render.ChatView("id", 0, "m", False, False, False, tool_plan(body))
    runs: Any = [SimpleNamespace(result=RunResult())]
    choices = Choices(runs, 1, 1, lambda: None)

    async def stream() -> AsyncIterator[tuple[int, TokenDelta]]:
        for k, text in enumerate(pieces):
            last = k == len(pieces) - 1
            yield 0, TokenDelta(k, text, None, "stop" if last else None)

    async def collect() -> list[dict[str, Any]]:
        return [c async for c in chat_render.chunks(view, choices, stream())]

    return [c["choices"][0] for c in asyncio.run(collect())][1:]  # after the role chunk


def test_a_streamed_hermes_call_arrives_as_one_tool_calls_delta() -> None:
    out = _render(["<tool", "_call>", '{"name": "get_time", ', '"arguments": {}}', "</tool_call>"])
    assert len(out) == 1
    calls = out[0]["delta"]["tool_calls"]
    assert calls[0]["function"] == {"name": "get_time", "arguments": "{}"}
    assert calls[0]["index"] == 0 and out[0]["finish_reason"] == "tool_calls"


def test_plain_text_streams_token_by_token_and_json_that_is_no_call_is_content() -> None:
    out = _render(["Hello", " there", "!"])
    assert [c["delta"].get("content") for c in out] == ["Hello", " there", "!"]
    assert out[-1]["finish_reason"] == "stop"
    held = _render(['{"a"', ": 1}"])
    assert (
        held == [{**held[0], "delta": {"content": '{"a": 1}'}, "finish_reason": "stop"}]
        and "tool_calls" not in held[0]["delta"]
    )
