"""`SamplingParams`: the per-request decoding settings, validated once when built."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gearshift.worker.structured.grammar import GrammarSpec

# Below this a temperature is treated as greedy, as vLLM does: dividing by it would overflow.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20
# OpenAI's documented range for a logit_bias value.
MAX_LOGIT_BIAS = 100.0
# Longest cache_salt accepted (vLLM sets none; a salt only has to be unguessable, not long).
MAX_CACHE_SALT_LENGTH = 1024
# torch.Generator.manual_seed accepts any value in [-2**63, 2**64).
_SEED_RANGE = (-(2**63), 2**64 - 1)


class InvalidSamplingParams(ValueError):
    """A sampling parameter is out of range; `field` names it (maps to HTTP 400)."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(message)


def _check_int(name: str, value: object, low: int | None = None, high: int | None = None) -> None:
    # bool is an int subclass; `max_tokens=True` is a client bug, not 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidSamplingParams(name, f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise InvalidSamplingParams(name, f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise InvalidSamplingParams(name, f"{name} must be <= {high}, got {value}")


def _check_float(name: str, value: object) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InvalidSamplingParams(name, f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise InvalidSamplingParams(name, f"{name} must be finite, got {value}")
    return float(value)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request; field names and defaults follow vLLM / OpenAI."""

    n: int = 1
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return; 0: only the chosen token
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Token id -> value added to its logit (OpenAI logit_bias).
    logit_bias: Mapping[int, float] = field(default_factory=dict, hash=False)
    # Non-empty: only these ids may be sampled (vLLM allowed_token_ids).
    allowed_token_ids: Sequence[int] = ()
    # Token sequences never to generate (vLLM bad_words, already tokenised).
    bad_words: Sequence[Sequence[int]] = ()
    # The grammar the output must match (structured outputs); None: free text.
    structured: GrammarSpec | None = None
    # Logprobs of the prompt tokens with this many alternatives (vLLM prompt_logprobs).
    prompt_logprobs: int | None = None
    # The prefix-cache salt (vLLM cache_salt; kv/block_manager.py): not a sampling setting, but
    # it travels wherever a request's parameters do. "": the shared, unsalted cache.
    cache_salt: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "logit_bias", dict(self.logit_bias))
        object.__setattr__(self, "bad_words", tuple(tuple(w) for w in self.bad_words))
        # Tuples keep the frozen dataclass hashable and unchanged by the caller's lists.
        for name in ("stop", "stop_token_ids", "allowed_token_ids"):
            value = getattr(self, name)
            if isinstance(value, str):  # OpenAI allows `"stop": "text"` for a single string
                value = (value,)
            try:
                object.__setattr__(self, name, tuple(value))
            except TypeError:
                raise InvalidSamplingParams(name, f"{name} must be a list, got {value!r}") from None
        self.validate()

    @property
    def greedy(self) -> bool:
        """Whether tokens are chosen by argmax."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_processors(self) -> bool:
        """Whether logit_bias, allowed_token_ids, bad_words or a grammar change the logits."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words or self.structured)

    @property
    def has_penalties(self) -> bool:
        """Whether any repetition, presence or frequency penalty changes the logits."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate(self) -> None:
        """Raise InvalidSamplingParams naming the first field out of range."""
        if not isinstance(self.cache_salt, str) or len(self.cache_salt) > MAX_CACHE_SALT_LENGTH:
            raise InvalidSamplingParams(
                "cache_salt",
                f"cache_salt must be a string of at most {MAX_CACHE_SALT_LENGTH} characters",
            )
        _check_int("n", self.n)
        if self.n != 1:
            raise InvalidSamplingParams(
                "n", f"n must be 1 (one sequence per request), got {self.n}"
            )
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidSamplingParams(
                "min_tokens",
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        if _check_float("temperature", self.temperature) < 0:
            raise InvalidSamplingParams(
                "temperature", f"temperature must be >= 0, got {self.temperature}"
            )
        top_p = _check_float("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise InvalidSamplingParams("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise InvalidSamplingParams(
                "top_k", f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k}"
            )
        if not 0.0 <= _check_float("min_p", self.min_p) <= 1.0:
            raise InvalidSamplingParams("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _check_int("seed", self.seed, *_SEED_RANGE)
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise InvalidSamplingParams(name, f"{name} must be in [-2, 2], got {value}")
        if _check_float("repetition_penalty", self.repetition_penalty) <= 0:
            raise InvalidSamplingParams(
                "repetition_penalty",
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
            )
        for index, stop_str in enumerate(self.stop):
            if not isinstance(stop_str, str) or not stop_str:
                raise InvalidSamplingParams(
                    "stop", f"stop[{index}] must be a non-empty string, got {stop_str!r}"
                )
        for index, token_id in enumerate(self.stop_token_ids):
            if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
                raise InvalidSamplingParams(
                    "stop_token_ids",
                    f"stop_token_ids[{index}] must be a token id >= 0, got {token_id!r}",
                )
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS)
        self._validate_processors()
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidSamplingParams(name, f"{name} must be a boolean")

    def _validate_processors(self) -> None:
        for token_id, bias in self.logit_bias.items():
            _check_int("logit_bias", token_id, low=0)
            if not -MAX_LOGIT_BIAS <= _check_float("logit_bias", bias) <= MAX_LOGIT_BIAS:
                raise InvalidSamplingParams(
                    "logit_bias", f"logit_bias[{token_id}] must be in [-100, 100], got {bias}"
                )
        for token_id in self.allowed_token_ids:
            _check_int("allowed_token_ids", token_id, low=0)
        for word in self.bad_words:
            if not word:
                raise InvalidSamplingParams("bad_words", "bad_words must not hold an empty entry")
            for token_id in word:
                _check_int("bad_words", token_id, low=0)

    def check_vocabulary(self, vocab_size: int) -> None:
        """Token ids of the processors must be the model's; raises naming the field."""
        fields: tuple[tuple[str, Sequence[int]], ...] = (
            ("logit_bias", tuple(self.logit_bias)),
            ("allowed_token_ids", self.allowed_token_ids),
            ("stop_token_ids", self.stop_token_ids),
            ("bad_words", tuple(t for w in self.bad_words for t in w)),
        )
        for name, ids in fields:
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise InvalidSamplingParams(
                    name, f"{name}: token id {bad} is outside the vocabulary (0..{vocab_size - 1})"
                )
        if self.top_k > vocab_size:
            raise InvalidSamplingParams(
                "top_k", f"top_k must be <= the vocabulary size ({vocab_size}), got {self.top_k}"
            )
