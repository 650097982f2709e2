"""/v1/completions answers from running choices: SSE chunks, or one whole response."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from gearshift.operator.router import openai_format
from gearshift.operator.router.choices import Choices
from gearshift.operator.router.generate import RunResult, TokenDelta


@dataclass(frozen=True)
class CompletionView:
    """What shapes the answer: ids, the echoed prompt, which extras the client asked for."""

    rid: str
    created: int
    model: str
    n: int  # choices per prompt: choice i answers prompt i // n
    echo: tuple[str, ...]  # per prompt: its text under echo, else ""
    want_logprobs: bool
    include_usage: bool
    continuous_usage: bool
    want_prompt_logprobs: bool = False
    # Under echo + logprobs, per prompt: its first token, which nothing before it scores.
    first_prompt_tokens: tuple[str, ...] = ()

    def echo_of(self, choice: int) -> str:
        return self.echo[choice // self.n]


def _echoed(
    view: CompletionView, index: int, result: RunResult
) -> openai_format.CompletionLogprobs:
    """Logprobs of the echoed prompt (echo + logprobs), before the generated tokens'."""
    acc = openai_format.CompletionLogprobs()
    if view.echo_of(index) and view.want_logprobs:
        first = view.first_prompt_tokens[index // view.n]
        acc.add_unscored(first, 0)
        offset = len(first)
        for entry in result.prompt_logprobs:
            acc.add(entry, offset)
            offset += len(entry.token)
    return acc


def _with_prompt(view: CompletionView, choice: dict[str, Any], result: RunResult) -> None:
    if view.want_prompt_logprobs:
        choice["prompt_logprobs"] = openai_format.prompt_logprobs(result.prompt_logprobs)


async def chunks(
    view: CompletionView, choices: Choices, stream: AsyncIterator[tuple[int, TokenDelta]]
) -> AsyncIterator[dict[str, Any]]:
    """One chunk per token of any choice, tagged with the choice's index."""
    texts: dict[int, str] = {}
    async for i, d in stream:
        result = choices.runs[i].result
        first = i not in texts
        so_far = texts.get(i, view.echo_of(i))
        text = (view.echo_of(i) if first else "") + d.text
        lp = None
        if view.want_logprobs and d.logprob is not None:
            acc = _echoed(view, i, result) if first else openai_format.CompletionLogprobs()
            acc.add(d.logprob, len(so_far))
            lp = acc.to_dict()
        texts[i] = so_far + d.text
        stop_reason = result.stop_reason if d.finish_reason else None
        choice = openai_format.completion_choice(i, text, lp, d.finish_reason, stop_reason)
        if first:
            _with_prompt(view, choice, result)
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
        text, acc = view.echo_of(r.index), _echoed(view, r.index, r.result)
        for d in r.deltas:
            if view.want_logprobs and d.logprob is not None:
                acc.add(d.logprob, len(text))
            text += d.text
        lp = acc.to_dict() if view.want_logprobs else None
        choice = openai_format.completion_choice(
            r.index, text, lp, r.result.finish_reason, r.result.stop_reason
        )
        _with_prompt(view, choice, r.result)
        out.append(choice)
    return openai_format.completion(view.rid, view.created, view.model, out, choices.usage())
