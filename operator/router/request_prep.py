"""The CPU work of preparing one request, as plain functions of (tokenizer, body, context).

Each runs in a preparation lane (lanes.py: a thread, or a process with its own tokenizer), so
its inputs and results are picklable and it touches no router state: bytes in, a checked and
tokenised request out (or a 400 naming the field). Order: JSON and its nesting, the size caps
(limits.py), validation, the model name, then templating, grammars and tokenisation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from gearshift.operator.router import errors, json_body, limits, request_params
from gearshift.operator.router.limits import RequestLimits
from gearshift.operator.router.openai_accounting import estimate_prompt_tokens
from gearshift.operator.router.protocol import (
    MAX_N,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
)
from gearshift.operator.router.structured_request import structured_spec
from gearshift.operator.router.text import TextOptions
from gearshift.operator.router.tool_calls import ToolPlan
from gearshift.v1 import common_pb2, router_pb2
from gearshift.worker.tokenizer import ChatTemplateError, Tokenizer


@dataclass(frozen=True)
class PrepContext:
    """What a preparation needs of the router: its model name, context length and caps."""

    model_name: str
    max_model_len: int | None
    limits: RequestLimits

    def check_model(self, model: str | None) -> None:
        if model and model != self.model_name:
            raise errors.model_not_found(model)


@dataclass(frozen=True)
class PreparedGeneration:
    """A completions or chat request, checked and tokenised, ready to start."""

    body: SamplingFields  # without its prompt or messages (the ids stand for them)
    prompts: list[list[int]]
    sampling: common_pb2.SamplingParams  # the parent's; child i gets seed + i
    echo: tuple[str, ...] = ()  # completions: each prompt's text under echo
    first: tuple[str, ...] = ()  # completions: each prompt's first token
    tools: ToolPlan | None = None  # chat


@dataclass(frozen=True)
class PreparedGenerate:
    """A gRPC Generate request, checked and tokenised."""

    prompt_token_ids: list[int]
    sampling: common_pb2.SamplingParams
    text: TextOptions


@dataclass(frozen=True)
class ProxyPlan:
    """A body for an openai-http group: checked, its prompt counted, re-encoded without
    `model` (each group's name for the model is put in front when it is sent)."""

    stream: bool
    output_limits: dict[str, Any] = field(default_factory=dict)  # max_tokens and its alias
    prompt_estimate: int = 0
    rest: bytes = b"{}"

    def content(self, model: str) -> bytes:
        head = b'{"model": ' + json.dumps(model).encode()
        return head + (b"}" if self.rest == b"{}" else b", " + self.rest[1:])


def _fields(*models: type[BaseModel]) -> frozenset[str]:
    names: set[str] = set(request_params.VLLM_UNSUPPORTED)
    for model in models:
        for name, info in model.model_fields.items():
            names.update({name, info.alias or name})
    return frozenset(names)


_GENERATION_FIELDS = _fields(CompletionRequest, ChatCompletionRequest)
_TOKENIZE_FIELDS = _fields(TokenizeRequest)


def _parsed(raw: bytes, ctx: PrepContext, known: frozenset[str]) -> dict[str, Any]:
    data = json_body.parse_object(raw, ctx.limits.max_json_depth)
    limits.check_generation(data, known, ctx.limits)
    return data


# ---- prompts ---------------------------------------------------------------------------------


def completion_prompts(tokenizer: Tokenizer, req: CompletionRequest) -> list[list[int]]:
    """Token ids of each prompt: a string or token ids, or a list of either (a batch)."""
    prompt: str | list[Any] = req.prompt
    batched = bool(prompt) and isinstance(prompt, list) and isinstance(prompt[0], (str, list))
    batch: list[Any] = list(prompt) if batched else [prompt]
    if len(batch) * req.num_sequences > MAX_N:
        raise errors.bad_request(
            f"prompts × best_of (or n) must be <= {MAX_N}, got {len(batch)} × {req.num_sequences}",
            "prompt",
        )
    out = []
    for p in batch:
        ids = (
            tokenizer.encode(p, add_special_tokens=req.add_special_tokens)
            if isinstance(p, str)
            else [int(t) for t in p]
        )
        if not ids:
            raise errors.bad_request("the prompt is empty", "prompt")
        request_params.check_token_ids(ids, tokenizer.vocab_size, "prompt")
        out.append(ids)
    return out


def chat_prompt(tokenizer: Tokenizer, req: ChatCompletionRequest) -> list[int]:
    """The chat template's prompt, tokenised."""
    if not req.messages:
        raise errors.bad_request("messages must not be empty", "messages")
    try:
        text = tokenizer.apply_chat_template_text(
            req.messages,
            add_generation_prompt=req.add_generation_prompt,
            tools=req.tools,
            **(req.chat_template_kwargs or {}),
        )
        return tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
    except ChatTemplateError as exc:
        raise errors.bad_request(str(exc), "messages") from exc
    except TypeError as exc:  # a chat_template_kwargs key clashing with a parameter
        raise errors.bad_request(str(exc), "chat_template_kwargs") from exc


# ---- HTTP ------------------------------------------------------------------------------------


def completion(tokenizer: Tokenizer, raw: bytes, ctx: PrepContext) -> PreparedGeneration:
    """A /v1/completions body."""
    body = json_body.validate(CompletionRequest, _parsed(raw, ctx, _GENERATION_FIELDS))
    ctx.check_model(body.model)
    if body.suffix:
        raise errors.bad_request("suffix is not supported", "suffix")
    prompts = completion_prompts(tokenizer, body)
    echo = tuple(tokenizer.decode(ids) if body.echo else "" for ids in prompts)
    first = tuple(tokenizer.decode(ids[:1], skip_special_tokens=False) for ids in prompts)
    spec, _ = structured_spec(body)
    sampling = request_params.plan_sampling(
        body, tokenizer, prompts, body.max_tokens, body.logprobs, "prompt", spec, ctx.max_model_len
    )
    limits.check_sampling_total(sampling, body.num_sequences * len(prompts), ctx.limits)
    kept = body.model_copy(update={"prompt": ""})
    return PreparedGeneration(kept, prompts, sampling, echo, first)


def chat(tokenizer: Tokenizer, raw: bytes, ctx: PrepContext) -> PreparedGeneration:
    """A /v1/chat/completions body."""
    body = json_body.validate(ChatCompletionRequest, _parsed(raw, ctx, _GENERATION_FIELDS))
    ctx.check_model(body.model)
    spec, tools = structured_spec(body)  # 400s about tools before the template sees them
    if body.stream and body.prompt_logprobs is not None:
        # Whole chat responses carry them (on the response, as vLLM does); streams do not.
        raise errors.bad_request(
            "prompt_logprobs: not available on streamed chat completions; drop stream or "
            "prompt_logprobs",
            "prompt_logprobs",
        )
    ids = chat_prompt(tokenizer, body)
    sampling = request_params.plan_sampling(
        body,
        tokenizer,
        [ids],
        body.output_limit,
        body.num_logprobs,
        "messages",
        spec,
        ctx.max_model_len,
    )
    limits.check_sampling_total(sampling, body.num_sequences, ctx.limits)
    kept = body.model_copy(update={"messages": []})
    return PreparedGeneration(kept, [ids], sampling, tools=tools)


def tokenize(tokenizer: Tokenizer, raw: bytes, ctx: PrepContext) -> bytes:
    """The /tokenize answer, as JSON."""
    body = json_body.validate(TokenizeRequest, _parsed(raw, ctx, _TOKENIZE_FIELDS))
    ctx.check_model(body.model)
    if body.messages is not None:
        chat_body = json_body.validate(
            ChatCompletionRequest,
            {"messages": body.messages, "add_generation_prompt": body.add_generation_prompt},
        )
        ids = chat_prompt(tokenizer, chat_body)
    elif body.prompt is not None:
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        raise errors.bad_request("one of prompt and messages is required", "prompt")
    strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    answer = {
        "count": len(ids),
        "max_model_len": ctx.max_model_len,
        "tokens": ids,
        "token_strs": strs,
    }
    return json.dumps(answer).encode()


def detokenize(tokenizer: Tokenizer, raw: bytes, ctx: PrepContext) -> bytes:
    """The /detokenize answer, as JSON."""
    data = json_body.parse_object(raw, ctx.limits.max_json_depth)
    limits.check(data, limits.DETOKENIZE_CAPS, ctx.limits)
    body = json_body.validate(DetokenizeRequest, data)
    ctx.check_model(body.model)
    if any(t < 0 or t >= tokenizer.vocab_size for t in body.tokens):
        raise errors.bad_request("a token id is outside the vocabulary", "tokens")
    return json.dumps({"prompt": tokenizer.decode(body.tokens)}).encode()


def proxied(tokenizer: Tokenizer, raw: bytes, ctx: PrepContext) -> ProxyPlan:
    """A completions or chat body for an openai-http group (which validates it itself)."""
    data = _parsed(raw, ctx, _GENERATION_FIELDS)
    model = data.pop("model", None)
    ctx.check_model(model if isinstance(model, str) else None)
    outputs: dict[str, Any] = {
        k: data[k] for k in ("max_completion_tokens", "max_tokens") if k in data
    }
    return ProxyPlan(
        stream=bool(data.get("stream")),
        output_limits=outputs,
        prompt_estimate=estimate_prompt_tokens(data, tokenizer),
        rest=json.dumps(data, ensure_ascii=False).encode(),
    )


# ---- gRPC ------------------------------------------------------------------------------------


def generate_view(request: router_pb2.GenerateRequest) -> dict[str, Any]:
    """The request's sized fields, as limits.GRPC_CAPS names them."""
    s = request.sampling
    kind = s.structured.WhichOneof("kind") if s.HasField("structured") else None
    structured: dict[str, Any] = {}
    if kind == "choice":
        structured["choice"] = list(s.structured.choice.choices)
    elif kind in ("regex", "grammar", "json_schema"):
        structured[kind] = getattr(s.structured, kind)
    return {
        "prompt_token_ids": list(request.prompt_token_ids),
        "sampling": {
            "stop": list(s.stop),
            "stop_token_ids": list(s.stop_token_ids),
            "allowed_token_ids": list(s.allowed_token_ids),
            "bad_words": [list(w.token_ids) for w in s.bad_words],
            "logit_bias": dict(s.logit_bias),
            "structured": structured,
        },
    }


def generate(
    tokenizer: Tokenizer, request: router_pb2.GenerateRequest, ctx: PrepContext
) -> PreparedGenerate:
    """A gRPC Generate request: prompt ids, worker sampling parameters, text options."""
    limits.check(generate_view(request), limits.GRPC_CAPS, ctx.limits)
    ctx.check_model(request.model or None)
    if bool(request.prompt) == bool(request.prompt_token_ids):
        raise errors.bad_request("set exactly one of prompt and prompt_token_ids")
    if request.prompt:
        ids = tokenizer.encode(request.prompt)
    else:
        ids = list(request.prompt_token_ids)
        request_params.check_token_ids(ids, tokenizer.vocab_size, "prompt_token_ids")
    s = request.sampling
    max_tokens = s.max_tokens if s.HasField("max_tokens") else None
    request_params.check_length(ids, max_tokens, "prompt", ctx.max_model_len)
    request_params.check_proto_sampling(s, tokenizer, len(ids), ctx.max_model_len)
    limits.check_sampling_total(s, 1, ctx.limits)
    sampling = common_pb2.SamplingParams()
    sampling.CopyFrom(s)
    del sampling.stop[:]  # stop strings are checked here, on the detokenised text
    text = TextOptions(
        stop=tuple(s.stop),
        include_stop_str_in_output=s.include_stop_str_in_output,
        skip_special_tokens=not s.HasField("skip_special_tokens") or s.skip_special_tokens,
        min_tokens=s.min_tokens,
    )
    return PreparedGenerate(ids, sampling, text)
