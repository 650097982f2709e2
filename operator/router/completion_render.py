"""/v1/completions answers from running choices: SSE chunks, or one whole response."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from gearshift.operator.router import openai_format
from gearshift.operator.router.choices import Choices
from gearshift.operator.router.generate import TokenDelta


@dataclass(frozen=True)
class CompletionView:
    """What shapes the answer: ids, the echoed prompt, which extras the client asked for."""

    rid: str
    created: int
    model: str
    echo: str
    want_logprobs: bool
    include_usage: bool
    continuous_usage: bool


def _logprobs(view: CompletionView, d: TokenDelta, offset: int) -> dict[str, Any] | None:
    if not view.want_logprobs or d.logprob is None:
        return None
    acc = openai_format.CompletionLogprobs()
    acc.add(d.logprob, offset)
    return acc.to_dict()


async def chunks(
    view: CompletionView, choices: Choices, stream: AsyncIterator[tuple[int, TokenDelta]]
) -> AsyncIterator[dict[str, Any]]:
    """One chunk per token of any choice, tagged with the choice's index."""
    texts: dict[int, str] = {}
    async for i, d in stream:
        first = i not in texts
        so_far = texts.get(i, view.echo)
        text = (view.echo if first else "") + d.text
        lp = _logprobs(view, d, len(so_far))
        texts[i] = so_far + d.text
        stop_reason = choices.runs[i].result.stop_reason if d.finish_reason else None
        choice = openai_format.completion_choice(i, text, lp, d.finish_reason, stop_reason)
        chunk = openai_format.completion_chunk(
            view.rid, view.created, view.model, choice, view.include_usage
        )
        if view.continuous_usage:
            chunk["usage"] = openai_format.usage(choices.usage())
        yield chunk
    if view.include_usage:
        yield openai_format.usage_chunk(
            view.rid, view.created, view.model, "text_completion", choices.usage()
        )


async def whole(view: CompletionView, choices: Choices) -> dict[str, Any]:
    out = []
    for r in await choices.collect():
        text, acc = view.echo, openai_format.CompletionLogprobs()
        for d in r.deltas:
            if view.want_logprobs and d.logprob is not None:
                acc.add(d.logprob, len(text))
            text += d.text
        lp = acc.to_dict() if view.want_logprobs else None
        out.append(
            openai_format.completion_choice(
                r.index, text, lp, r.result.finish_reason, r.result.stop_reason
            )
        )
    return openai_format.completion(view.rid, view.created, view.model, out, choices.usage())
