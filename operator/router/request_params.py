"""From a validated OpenAI body to worker parameters: token-id and context checks that need
the tokenizer, and the proto each child sequence is sent with."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from gearshift.operator.router import errors
from gearshift.operator.router.protocol import MAX_LOGPROBS, SamplingFields
from gearshift.operator.router.text import TextOptions
from gearshift.v1 import common_pb2
from gearshift.worker.structured.grammar import (
    GrammarSpec,
    InvalidGrammar,
    compile_grammar,
    spec_from_proto,
    spec_to_proto,
)
from gearshift.worker.tokenizer import Tokenizer

log = logging.getLogger(__name__)
_INT64 = 2**63


@dataclass
class IgnoredFields:
    """Unknown fields are logged once per router and ignored (vLLM's behaviour); the names
    already logged are remembered up to `limit` (a client must not grow the router's memory)."""

    limit: int = 256
    seen: set[str] = field(default_factory=set)
    full: bool = False

    def note(self, body: SamplingFields) -> None:
        for name in sorted(body.model_extra or ()):
            if name in self.seen or name in VLLM_UNSUPPORTED:
                continue
            if len(self.seen) >= self.limit:
                if not self.full:
                    self.full = True
                    log.warning(
                        "%d unknown request fields logged; further ones are ignored silently",
                        self.limit,
                    )
                return
            self.seen.add(name)
            log.warning("request field %r is not supported and was ignored", name[:64])


def check_unsupported(body: SamplingFields) -> None:
    """Fields vLLM honours and we do not are refused unless they hold vLLM's default (a no-op)."""
    for name in sorted(body.model_extra or ()):
        value = (body.model_extra or {})[name]
        if name in VLLM_UNSUPPORTED and value not in VLLM_UNSUPPORTED[name]:
            raise errors.bad_request(f"{name} is not supported by this server", name)


# vLLM request fields we do not implement -> the values that mean "off" in vLLM (accepted).
VLLM_UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "use_beam_search": (False, None),
    "length_penalty": (1, 1.0, None),
    "truncate_prompt_tokens": (None,),
    "spaces_between_special_tokens": (True, None),
    "continue_final_message": (False, None),
    "documents": (None,),
    "chat_template": (None,),
    "mm_processor_kwargs": (None,),
    "prompt_embeds": (None,),
    "priority": (0, None),
    "cache_salt": (None,),
    "return_tokens_as_token_ids": (False, None),
    "return_token_ids": (False, None),
    "logits_processors": (None,),
    "kv_transfer_params": (None,),
    "vllm_xargs": (None,),
    "guided_whitespace_pattern": (None,),
    "echo_prompt": (False, None),
    "reasoning_effort": (None,),
}


def check_token_ids(ids: Iterable[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise errors.bad_request(
            f"{param}: token id {bad} is outside the vocabulary (0..{vocab_size - 1})", param
        )


def bad_word_ids(words: Sequence[str], tokenizer: Tokenizer) -> list[list[int]]:
    """Token sequences of each bad word, as vLLM bans them: alone and after a space."""
    out: list[list[int]] = []
    for word in words:
        for variant in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(variant, add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out


def check_length(
    ids: Sequence[int], max_tokens: int | None, prompt_param: str, limit: int | None
) -> None:
    """vLLM's context-length checks, when a worker has told us the length (`limit`)."""
    if limit is None:
        return
    if len(ids) >= limit:
        raise errors.APIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, your prompt "
            f"has {len(ids)} tokens, which leaves no room to generate.",
            "invalid_request_error",
            prompt_param,
            "context_length_exceeded",
        )
    if max_tokens is not None and len(ids) + max_tokens > limit:
        raise errors.APIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the "
            "completion). Please reduce the prompt or the completion length.",
            "invalid_request_error",
            "max_tokens",
            "context_length_exceeded",
        )


def check_context(body: SamplingFields, prompt_len: int, max_model_len: int | None) -> None:
    """min_tokens must fit the context the prompt leaves (vLLM's check)."""
    if max_model_len is not None and prompt_len + body.min_tokens > max_model_len:
        raise errors.bad_request(
            f"min_tokens ({body.min_tokens}) leaves no room: the prompt has {prompt_len} tokens "
            f"and the maximum context length is {max_model_len}",
            "min_tokens",
        )


def sampling_proto(
    body: SamplingFields,
    tokenizer: Tokenizer,
    max_tokens: int | None,
    logprobs: int | None,
    spec: GrammarSpec | None,
) -> common_pb2.SamplingParams:
    """Worker parameters; stop strings stay on the router, which detokenises."""
    vocab = tokenizer.vocab_size
    if body.top_k is not None and body.top_k > vocab:
        raise errors.bad_request(
            f"top_k must be <= the vocabulary size ({vocab}), got {body.top_k}", "top_k"
        )
    check_token_ids(body.stop_token_ids or (), vocab, "stop_token_ids")
    check_token_ids(body.allowed_token_ids or (), vocab, "allowed_token_ids")
    bias: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise errors.bad_request(
                f"logit_bias keys must be token ids, got {key[:40]!r}", "logit_bias"
            ) from None
        if not -100.0 <= value <= 100.0:
            raise errors.bad_request(
                f"logit_bias values must be in [-100, 100], got {value}", "logit_bias"
            )
        bias[token] = value
    check_token_ids(bias, vocab, "logit_bias")
    p = common_pb2.SamplingParams(
        min_tokens=body.min_tokens,
        top_k=body.top_k if body.top_k and body.top_k > 0 else 0,
        min_p=body.min_p or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        stop_token_ids=body.stop_token_ids or [],
        ignore_eos=body.ignore_eos,
        skip_special_tokens=body.skip_special_tokens,
        logit_bias=bias,
        allowed_token_ids=body.allowed_token_ids or [],
    )
    for ids in bad_word_ids(body.bad_words or (), tokenizer):
        p.bad_words.add(token_ids=ids)
    if spec is not None:
        p.structured.CopyFrom(spec_to_proto(spec))
    if max_tokens is not None:
        p.max_tokens = max_tokens
    if body.temperature is not None:
        p.temperature = body.temperature
    if body.top_p is not None:
        p.top_p = body.top_p
    if body.seed is not None:
        p.seed = body.seed
    if body.repetition_penalty is not None:
        p.repetition_penalty = body.repetition_penalty
    if logprobs is not None:
        p.logprobs = logprobs
    echo_logprobs = getattr(body, "echo", False) and logprobs is not None
    if body.prompt_logprobs is not None or echo_logprobs:
        p.prompt_logprobs = max(body.prompt_logprobs or 0, logprobs or 0)
    return p


def plan_sampling(
    body: SamplingFields,
    tokenizer: Tokenizer,
    prompts: Sequence[Sequence[int]],
    max_tokens: int | None,
    logprobs: int | None,
    prompt_param: str,
    spec: GrammarSpec | None,
    max_model_len: int | None,
) -> common_pb2.SamplingParams:
    """Every check of a body against its prompts and the context, then its worker parameters."""
    for ids in prompts:
        check_length(ids, max_tokens, prompt_param, max_model_len)
        check_context(body, len(ids), max_model_len)
    check_unsupported(body)
    if body.best_of is not None and body.best_of > body.n and logprobs is None:
        logprobs = 0  # best_of ranks by cumulative logprob; the client does not see them
    return sampling_proto(body, tokenizer, max_tokens, logprobs, spec)


def child_sampling(p: common_pb2.SamplingParams, index: int) -> common_pb2.SamplingParams:
    """Sequence `index` of an n > 1 request: seed + index, so each differs yet all reproduce."""
    if index == 0 or not p.HasField("seed"):
        return p
    child = common_pb2.SamplingParams()
    child.CopyFrom(p)
    child.seed = (p.seed + index + _INT64) % (2 * _INT64) - _INT64  # wrap inside int64
    return child


def text_options(body: SamplingFields) -> TextOptions:
    return TextOptions(
        stop=body.stop_strings(),
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        min_tokens=body.min_tokens,
    )


def check_proto_sampling(
    s: common_pb2.SamplingParams, tokenizer: Tokenizer, prompt_len: int, max_model_len: int | None
) -> None:
    """The gRPC API's twin of the body checks: what the proto's types do not already bound."""
    if any(not text for text in s.stop):
        raise errors.bad_request("stop strings must be non-empty", "stop")
    vocab = tokenizer.vocab_size
    if s.top_k < -1 or s.top_k > vocab:
        raise errors.bad_request(f"top_k must be -1, 0 or in [1, {vocab}], got {s.top_k}", "top_k")
    if s.HasField("logprobs") and s.logprobs > MAX_LOGPROBS:
        raise errors.bad_request(f"logprobs must be <= {MAX_LOGPROBS}", "logprobs")
    if s.HasField("prompt_logprobs") and s.prompt_logprobs > MAX_LOGPROBS:
        raise errors.bad_request(f"prompt_logprobs must be <= {MAX_LOGPROBS}", "prompt_logprobs")
    if max_model_len is not None and prompt_len + s.min_tokens > max_model_len:
        raise errors.bad_request(
            f"min_tokens ({s.min_tokens}) does not fit the context ({max_model_len} tokens)",
            "min_tokens",
        )
    check_token_ids(s.stop_token_ids, vocab, "stop_token_ids")
    check_token_ids(s.allowed_token_ids, vocab, "allowed_token_ids")
    check_token_ids(s.logit_bias, vocab, "logit_bias")
    check_token_ids((t for w in s.bad_words for t in w.token_ids), vocab, "bad_words")
    if any(not -100.0 <= v <= 100.0 for v in s.logit_bias.values()):
        raise errors.bad_request("logit_bias values must be in [-100, 100]", "logit_bias")
    if any(not w.token_ids for w in s.bad_words):
        raise errors.bad_request("bad_words entries must be non-empty", "bad_words")
    spec = spec_from_proto(s.structured) if s.HasField("structured") else None
    if spec is not None:
        try:
            compile_grammar(spec)
        except InvalidGrammar as exc:
            raise errors.bad_request(f"structured: {str(exc)[:500]}", "structured") from None
