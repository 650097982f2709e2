"""What the engine hands back: per-step deltas for streaming and whole results for ``generate``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gearshift.worker.engine.sequence import FinishReason

if TYPE_CHECKING:
    from gearshift.worker.sampling.logprobs import TokenLogprobs


@dataclass(frozen=True)
class RequestMetrics:
    """Monotonic timestamps (seconds) of a request's life, for TTFT / queue-time metrics."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None


@dataclass
class RequestOutput:
    """One request's progress in one step: the tokens (and text) it gained, and whether it ended."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    metrics: RequestMetrics
    new_logprobs: list[TokenLogprobs] | None = None
    error: str | None = None
    # With prompt_logprobs: every prompt token's from the second on, on the first output only.
    prompt_logprobs: list[TokenLogprobs] | None = None


@dataclass
class CompletionOutput:
    """A finished request as ``generate`` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
