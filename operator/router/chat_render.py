"""/v1/chat/completions answers from running choices: SSE chunks or one whole response, with
tool calls parsed out of the text when the request has tools."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from gearshift.operator.router import openai_format
from gearshift.operator.router.choices import Choices
from gearshift.operator.router.generate import TokenDelta
from gearshift.operator.router.tool_calls import ToolPlan, may_be_tool_call, parse_tool_calls


@dataclass(frozen=True)
class ChatView:
    rid: str
    created: int
    model: str
    want_logprobs: bool
    include_usage: bool
    continuous_usage: bool
    tools: ToolPlan | None
    want_prompt_logprobs: bool = False


def _finish(view: ChatView, reason: str | None, has_calls: bool) -> str | None:
    # OpenAI: "tool_calls" when the model chose to call; a forced named call ends with "stop".
    if reason == "stop" and has_calls and view.tools is not None and view.tools.mode != "named":
        return "tool_calls"
    return reason


def _message(view: ChatView, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    if view.tools is None:
        return text, []
    content, calls = parse_tool_calls(view.tools, text)
    return content, [c.to_dict() for c in calls]


async def chunks(
    view: ChatView, choices: Choices, stream: AsyncIterator[tuple[int, TokenDelta]]
) -> AsyncIterator[dict[str, Any]]:
    """A role chunk per choice, then deltas; text that may be a tool call is held until the
    choice ends, then sent as tool_calls (or as content when it was not one after all)."""

    def chunk(choice: dict[str, Any]) -> dict[str, Any]:
        out = openai_format.chat_chunk(
            view.rid, view.created, view.model, choice, view.include_usage
        )
        if view.continuous_usage:
            out["usage"] = openai_format.usage(choices.usage())
        return out

    for i in range(choices.n):
        role = {"role": "assistant", "content": ""}
        yield chunk(openai_format.chat_choice(i, role, None, None, None, delta=True))
    held: dict[int, str] = {}
    sent: dict[int, str] = {}
    async for i, d in stream:
        lp = [openai_format.chat_logprob(d.logprob)] if view.want_logprobs and d.logprob else None
        stop_reason = choices.runs[i].result.stop_reason if d.finish_reason else None
        if view.tools is not None and (i in held or not sent.get(i)):
            text = held.get(i, "") + d.text
            if d.finish_reason is None and may_be_tool_call(text):
                held[i] = text
                if lp is None:
                    continue
                delta: dict[str, Any] = {}
            elif d.finish_reason is not None:
                held.pop(i, None)
                content, calls = _message(view, text)
                delta = (
                    {"tool_calls": [dict(c, index=k) for k, c in enumerate(calls)]} if calls else {}
                )
                if content:
                    delta["content"] = content
                reason = _finish(view, d.finish_reason, bool(calls))
                yield chunk(
                    openai_format.chat_choice(i, delta, lp, reason, stop_reason, delta=True)
                )
                continue
            else:
                held.pop(i, None)
                delta = {"content": text}
                sent[i] = text
        else:
            delta = {"content": d.text} if d.token_id is not None or d.text else {}
            sent[i] = sent.get(i, "") + d.text
        yield chunk(
            openai_format.chat_choice(i, delta, lp, d.finish_reason, stop_reason, delta=True)
        )
    if view.include_usage:
        yield openai_format.usage_chunk(
            view.rid, view.created, view.model, "chat.completion.chunk", choices.usage()
        )


async def whole(view: ChatView, choices: Choices) -> dict[str, Any]:
    out = []
    for r in await choices.collect():
        text = "".join(d.text for d in r.deltas)
        lps = [openai_format.chat_logprob(d.logprob) for d in r.deltas if d.logprob is not None]
        content, calls = _message(view, text)
        message = openai_format.chat_message(content, calls)
        reason = _finish(view, r.result.finish_reason, bool(calls))
        out.append(
            openai_format.chat_choice(
                r.index, message, lps if view.want_logprobs else None, reason, r.result.stop_reason
            )
        )
    response = openai_format.chat_completion(
        view.rid, view.created, view.model, out, choices.usage()
    )
    if view.want_prompt_logprobs:  # vLLM puts the chat's on the response, not a choice
        entries = choices.runs[0].result.prompt_logprobs
        response["prompt_logprobs"] = openai_format.prompt_logprobs(entries)
    return response
