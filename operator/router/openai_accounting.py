"""What the router measures of a request it forwards to an openai-http group: the load estimate
used for routing, and the request metrics (the same ones as for worker groups).

Token counts come from the answer's `usage`. A stream whose client did not ask for usage is not
changed to get it (vLLM then moves fields between chunks, so the answer would differ from vLLM's
own), so its counts are estimates: our tokenizer's count of the prompt text, one token per chunk
with output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from gearshift.operator.router.group import Lease
from gearshift.operator.router.metrics import RouterMetrics
from gearshift.worker.tokenizer import Tokenizer


def estimate_prompt_tokens(body: dict[str, Any], tokenizer: Tokenizer) -> int:
    """Prompt tokens for routing only (the backend counts for real): text through our
    tokenizer, without the chat template; token ids count one each."""
    texts: list[str] = []
    count = 0

    def walk(x: Any) -> None:
        nonlocal count
        if isinstance(x, str):
            texts.append(x)
        elif isinstance(x, int):
            count += 1
        elif isinstance(x, list):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)

    walk(body.get("prompt", body.get("messages")))
    text = "\n".join(texts)
    return count + (len(tokenizer.encode(text)) if text else 0)


def requested_max_tokens(
    body: dict[str, Any], prompt_tokens: int, max_model_len: int | None
) -> int:
    """The output bound the load estimate uses: the request's, else the rest of the context."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and value >= 0:
            return value
    return max(0, max_model_len - prompt_tokens) if max_model_len else 0


def has_output(choice: Any) -> bool:
    """A streamed choice that carries generated text or a tool call."""
    if not isinstance(choice, dict):
        return False
    if choice.get("text"):
        return True
    delta = choice.get("delta")
    return isinstance(delta, dict) and bool(delta.get("content") or delta.get("tool_calls"))


@dataclass
class ProxyAccount:
    """Timing and token counts of one forwarded request, recorded once when it ends."""

    metrics: RouterMetrics
    prompt_estimate: int
    arrival: float = field(default_factory=time.monotonic)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    has_counts: bool = False  # the backend sent usage
    finish_reason: str | None = None
    first: float | None = None
    last: float | None = None
    chunks: int = 0  # chunks with output so far
    recorded: bool = False

    def on_chunk(self, lease: Lease, chunk: dict[str, Any]) -> None:
        now = time.monotonic()
        self.read_usage(chunk)
        produced = sum(1 for c in chunk.get("choices") or [] if has_output(c))
        if not produced:
            return
        lease.on_tokens(produced)
        self.chunks += 1
        if self.first is None:
            self.first = now
        elif self.last is not None:
            self.metrics.itl.labels(self.metrics.model_name).observe(now - self.last)
        self.last = now

    def read_usage(self, answer: dict[str, Any]) -> None:
        usage = answer.get("usage")
        if isinstance(usage, dict):
            self.has_counts = True
            self.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            self.completion_tokens = int(usage.get("completion_tokens") or 0)
        for c in answer.get("choices") or []:
            if isinstance(c, dict) and c.get("finish_reason"):
                self.finish_reason = str(c["finish_reason"])

    def reject(self, status: int) -> None:
        """A refused request records no request metrics; the router's RejectionCounter
        (rejections.py) counts the 4xx/5xx it returns, the backend's included."""
        del status
        self.recorded = True

    def record(self, reason: str, streamed: bool = True) -> None:
        """The finished request's metrics; `streamed` False: no first-token time exists."""
        if self.recorded:
            return
        self.recorded = True
        if not self.has_counts:  # a stream without usage: estimates (module docstring)
            self.prompt_tokens, self.completion_tokens = self.prompt_estimate, self.chunks
        first, last = (self.first, self.last) if streamed else (None, None)
        self.metrics.observe_finished(
            finish_reason=reason,
            prompt_tokens=self.prompt_tokens,
            output_tokens=self.completion_tokens,
            e2e=time.monotonic() - self.arrival,
            ttft=first - self.arrival if first is not None else None,
            decode_time=last - first if first is not None and last is not None else None,
            queue_time=None,
        )
