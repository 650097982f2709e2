"""Per-request text on the router: incremental detokenisation, stop strings, logprob tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gearshift.v1 import common_pb2
from gearshift.worker.tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer


@dataclass(frozen=True)
class TopEntry:
    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True)
class LogprobEntry:
    """A sampled token's logprob and its top alternatives, with their decoded text."""

    token_id: int
    token: str
    logprob: float
    top: tuple[TopEntry, ...]
    rank: int = 0  # 1: the most likely token; 0: not known


@dataclass(frozen=True)
class TextOptions:
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0


@dataclass(frozen=True)
class TextStep:
    """What one output token adds: its text, and the stop string it completed, if any."""

    text: str
    stop_str: str | None = None


class TextState:
    """Turns a request's output tokens into text deltas, cut exactly at the first stop string."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], options: TextOptions
    ) -> None:
        self.tokenizer = tokenizer
        self.options = options
        self.detok = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens=options.skip_special_tokens
        )
        self.stop = (
            StopChecker(options.stop, options.include_stop_str_in_output) if options.stop else None
        )
        self.num_tokens = 0
        self.text = ""

    def feed(self, token_id: int, last: bool) -> TextStep:
        """Add one token; `last` when the worker finished the request with it."""
        self.num_tokens += 1
        text = self.detok.step([token_id])
        if last:
            text += self.detok.flush()
        step = TextStep(text)
        # Like the engine: stop strings count only once min_tokens are out.
        if self.stop is not None and self.num_tokens >= self.options.min_tokens:
            result = self.stop.feed(text)
            step = TextStep(result.text, result.stop_str if result.stopped else None)
            if last and not result.stopped:
                step = TextStep(step.text + self.stop.flush())
        self.text += step.text
        return step

    def finish(self) -> str:
        """Text still held back when the request ends without a token (an abort)."""
        text = self.detok.flush()
        if self.stop is not None:
            text = self.stop.feed(text).text + self.stop.flush()
        self.text += text
        return text

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def logprob(self, lp: common_pb2.TokenLogprob) -> LogprobEntry:
        top = tuple(
            TopEntry(t.token_id, self.token_text(t.token_id), t.logprob) for t in lp.top_logprobs
        )
        return LogprobEntry(lp.token_id, self.token_text(lp.token_id), lp.logprob, top, lp.rank)
