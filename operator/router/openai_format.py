"""OpenAI response objects: completions and chat completions, whole and as stream chunks."""

from __future__ import annotations

from typing import Any

from gearshift.operator.router.generate import RunResult
from gearshift.operator.router.text import LogprobEntry


def usage(result: RunResult) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
    }
    if result.cached_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": result.cached_tokens}
    return out


# ---- /v1/completions ---------------------------------------------------------------------


class CompletionLogprobs:
    """The legacy completions `logprobs` object, built token by token."""

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add_unscored(self, token: str, offset: int) -> None:
        """The prompt's first token under echo: nothing came before it to score it."""
        self.tokens.append(token)
        self.token_logprobs.append(None)
        self.top_logprobs.append(None)
        self.text_offset.append(offset)

    def add(self, entry: LogprobEntry, offset: int) -> None:
        self.tokens.append(entry.token)
        self.token_logprobs.append(entry.logprob)
        top = {t.token: t.logprob for t in entry.top}
        top.setdefault(entry.token, entry.logprob)  # vLLM lists the sampled token too
        self.top_logprobs.append(top)
        self.text_offset.append(offset)

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


def prompt_logprobs(entries: list[LogprobEntry]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: None for the first token, then {token id: {logprob, rank,
    decoded_token}} holding the prompt's own token and the top alternatives."""
    out: list[dict[str, Any] | None] = [None]
    for e in entries:
        position = {
            str(t.token_id): {"logprob": t.logprob, "rank": k + 1, "decoded_token": t.token}
            for k, t in enumerate(e.top)
        }
        position[str(e.token_id)] = {
            "logprob": e.logprob,
            "rank": e.rank,
            "decoded_token": e.token,
        }
        out.append(position)
    return out


def _response(
    rid: str, obj: str, created: int, model: str, choices: list[dict[str, Any]]
) -> dict[str, Any]:
    """The envelope every completion response and chunk shares."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}


def completion_choice(
    index: int,
    text: str,
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
    stop_reason: str | int | None,
) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def completion(
    rid: str, created: int, model: str, choices: list[dict[str, Any]], r: RunResult
) -> dict[str, Any]:
    return {**_response(rid, "text_completion", created, model, choices), "usage": usage(r)}


def completion_chunk(
    rid: str, created: int, model: str, choice: dict[str, Any], include_usage: bool = False
) -> dict[str, Any]:
    chunk = _response(rid, "text_completion", created, model, [choice])
    if include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(rid: str, created: int, model: str, obj: str, r: RunResult) -> dict[str, Any]:
    """The last chunk with `stream_options.include_usage`: no choices, the usage."""
    return {**_response(rid, obj, created, model, []), "usage": usage(r)}


# ---- /v1/chat/completions ----------------------------------------------------------------


def chat_logprob(entry: LogprobEntry) -> dict[str, Any]:
    return {
        "token": entry.token,
        "logprob": entry.logprob,
        "bytes": list(entry.token.encode("utf-8")),
        "top_logprobs": [
            {"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode("utf-8"))}
            for t in entry.top
        ],
    }


def chat_message(content: str | None, tool_calls: list[dict[str, Any]]) -> dict[str, Any]:
    return {"role": "assistant", "content": content, "tool_calls": tool_calls}


def chat_choice(
    index: int,
    message: dict[str, Any],
    logprobs: list[dict[str, Any]] | None,
    finish_reason: str | None,
    stop_reason: str | int | None,
    *,
    delta: bool = False,
) -> dict[str, Any]:
    return {
        "index": index,
        "delta" if delta else "message": message,
        "logprobs": {"content": logprobs} if logprobs is not None else None,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
    }


def chat_completion(
    rid: str, created: int, model: str, choices: list[dict[str, Any]], r: RunResult
) -> dict[str, Any]:
    return {**_response(rid, "chat.completion", created, model, choices), "usage": usage(r)}


def chat_chunk(
    rid: str, created: int, model: str, choice: dict[str, Any], include_usage: bool = False
) -> dict[str, Any]:
    chunk = _response(rid, "chat.completion.chunk", created, model, [choice])
    if include_usage:
        chunk["usage"] = None
    return chunk


def model_list(model: str, root: str, created: int, max_model_len: int | None) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": model,
                "object": "model",
                "created": created,
                "owned_by": "gearshift",
                "root": root,
                "parent": None,
                "max_model_len": max_model_len,
            }
        ],
    }
