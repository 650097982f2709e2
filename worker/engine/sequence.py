"""Per-request state the leader keeps while a request is queued, running or finishing."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gearshift.worker.kv.block_manager import BlockTable

if TYPE_CHECKING:
    import torch

    from gearshift.worker.sampling.logprobs import TokenLogprobs
    from gearshift.worker.sampling.params import SamplingParams
    from gearshift.worker.structured.matcher import GrammarMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    """Why a request ended; the values are what OpenAI-style APIs report."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(eq=False)
class Sequence:
    """One request: its tokens, how many have KV computed, and the blocks that hold that KV."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens capped by the model length
    arrival_time: float = field(default_factory=time.monotonic)
    generator: torch.Generator | None = None
    grammar: GrammarMatcher | None = None  # structured outputs: advanced by the sampler
    # With params.prompt_logprobs: filled chunk by chunk while the prompt is prefilled.
    prompt_logprobs: list[TokenLogprobs] | None = None
    # The prefix-cache salt (params.cache_salt, vLLM's): the scheduler and the block manager
    # read it here, so sequences without sampling parameters (the simulator's) need none.
    cache_salt: str = ""
    token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache on first schedule
    num_preemptions: int = 0
    blocks: BlockTable = field(default_factory=BlockTable)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt rows must still produce logits (so no prefix-cache hit may skip them)."""
        return (
            self.prompt_logprobs is not None
            and len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
