"""The router's shared state, and a request's way from a body to a `RequestRun`."""

from __future__ import annotations

import asyncio
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any

from gearshift.operator.router import cache_salt, errors, request_params
from gearshift.operator.router.choices import Choices
from gearshift.operator.router.config import RouterConfig
from gearshift.operator.router.generate import PreparedRequest, RequestRun
from gearshift.operator.router.metrics import RouterMetrics
from gearshift.operator.router.pool import GroupPool
from gearshift.operator.router.protocol import (
    MAX_N,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    lone_surrogate_path,
)
from gearshift.operator.router.structured_request import structured_spec
from gearshift.worker.tokenizer import ChatTemplateError, Tokenizer


@dataclass
class Router:
    """Config, tokenizer, groups and metrics of one router process."""

    config: RouterConfig
    tokenizer: Tokenizer
    pool: GroupPool
    metrics: RouterMetrics
    accepting: bool = True  # False while draining for shutdown
    created: int = field(default_factory=lambda: int(time.time()))
    # Client request ids in flight: a second request with the same id is refused (409).
    active_ids: set[str] = field(default_factory=set)
    ignored_fields: request_params.IgnoredFields = field(
        default_factory=request_params.IgnoredFields
    )
    # Requests not yet garbage: the drain cuts off those still running at its timeout.
    runs: weakref.WeakSet[RequestRun] = field(default_factory=weakref.WeakSet)

    @property
    def model_name(self) -> str:
        return self.config.model_name

    def check_model(self, model: str | None) -> None:
        if model and model != self.model_name:
            raise errors.model_not_found(model)

    def check_accepting(self) -> None:
        if not self.accepting:
            raise errors.unavailable("the server is shutting down")

    @staticmethod
    def check_text(body: object) -> None:
        """Refuse strings no tokenizer or UTF-8 answer can carry (before any is echoed)."""
        path = lone_surrogate_path(body)
        if path is not None:
            param = path.split(".")[0]
            raise errors.bad_request(f"{path}: a string holds a lone UTF-16 surrogate", param)

    # ---- prompts --------------------------------------------------------------------------

    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        """Token ids of each prompt: a string or token ids, or a list of either (a batch)."""
        prompt: str | list[Any] = req.prompt
        batched = bool(prompt) and isinstance(prompt, list) and isinstance(prompt[0], (str, list))
        batch: list[Any] = list(prompt) if batched else [prompt]
        if len(batch) * req.num_sequences > MAX_N:
            raise errors.bad_request(
                f"prompts × best_of (or n) must be <= {MAX_N}, got {len(batch)} × "
                f"{req.num_sequences}",
                "prompt",
            )
        out = []
        for p in batch:
            ids = (
                self.tokenizer.encode(p, add_special_tokens=req.add_special_tokens)
                if isinstance(p, str)
                else [int(t) for t in p]
            )
            if not ids:
                raise errors.bad_request("the prompt is empty", "prompt")
            request_params.check_token_ids(ids, self.tokenizer.vocab_size, "prompt")
            out.append(ids)
        return out

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        if not req.messages:
            raise errors.bad_request("messages must not be empty", "messages")
        try:
            text = self.tokenizer.apply_chat_template_text(
                req.messages,
                add_generation_prompt=req.add_generation_prompt,
                tools=req.tools,
                **(req.chat_template_kwargs or {}),
            )
            return self.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
        except ChatTemplateError as exc:
            raise errors.bad_request(str(exc), "messages") from exc
        except TypeError as exc:  # a chat_template_kwargs key clashing with a parameter
            raise errors.bad_request(str(exc), "chat_template_kwargs") from exc

    def check_length(self, ids: list[int], max_tokens: int | None, prompt_param: str) -> None:
        """vLLM's context-length checks, when a worker has told us the length."""
        limit = self.pool.max_model_len
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

    # ---- requests -------------------------------------------------------------------------

    def start(
        self,
        body: SamplingFields,
        prompts: list[list[int]],
        max_tokens: int | None,
        logprobs: int | None,
        prompt_param: str,
        prefix: str,
        key_salt: str = "",
    ) -> tuple[str, Choices]:
        """Validate against the context and vocabulary, then start the request's sequences.

        Returns the response id (the client's request_id when given, as vLLM does) and the
        running choices, `best_of` (or `n`) per prompt in prompt order; closing them frees
        the id. `key_salt`: the API key's prefix-cache salt when salting by key (cache_salt.py).
        """
        self.check_accepting()
        self.check_model(body.model)
        for ids in prompts:
            self.check_length(ids, max_tokens, prompt_param)
            request_params.check_context(body, len(ids), self.pool.max_model_len)
        self.ignored_fields.note(body)
        spec, _ = structured_spec(body)
        if body.best_of is not None and body.best_of > body.n and logprobs is None:
            logprobs = 0  # best_of ranks by cumulative logprob; the client does not see them
        sampling = request_params.sampling_proto(body, self.tokenizer, max_tokens, logprobs, spec)
        sampling.cache_salt = cache_salt.combine(body.cache_salt, key_salt)
        rid = body.request_id or f"{prefix}-{uuid.uuid4().hex}"
        self.claim_id(rid)
        count = body.num_sequences
        runs = [
            self.run(
                PreparedRequest(
                    request_id=rid if count * len(prompts) == 1 else f"{rid}-{k}-{i}",
                    prompt_token_ids=ids,
                    sampling=request_params.child_sampling(sampling, i),
                    text=request_params.text_options(body),
                )
            )
            for k, ids in enumerate(prompts)
            for i in range(count)
        ]
        return rid, Choices(runs, body.n, count, lambda: self.active_ids.discard(rid))

    def claim_id(self, rid: str) -> None:
        if rid in self.active_ids:
            raise errors.APIError(
                409,
                "a request with this request_id is already running",
                "invalid_request_error",
                "request_id",
                "request_id_in_use",
            )
        self.active_ids.add(rid)

    def run(self, request: PreparedRequest) -> RequestRun:
        run = RequestRun(self.pool, self.tokenizer, self.metrics, request)
        self.runs.add(run)
        return run

    async def drain(self, timeout_s: float, cut_off_wait_s: float = 5.0) -> int:
        """Refuse new requests and wait (bounded) for those in flight; returns those left.

        After `timeout_s` the requests still running are cut off (`RequestRun.cut`): streams end
        with an error event and `[DONE]`, gRPC streams with UNAVAILABLE, other requests with a
        503; `cut_off_wait_s` bounds the wait for them to say so.
        """
        self.accepting = False
        deadline = time.monotonic() + timeout_s
        while self.pool.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.pool.in_flight:
            error = errors.unavailable(
                "the server is shutting down and this request did not finish within the drain "
                "timeout"
            )
            for run in list(self.runs):
                run.cut(error)
            deadline = time.monotonic() + cut_off_wait_s
            while self.pool.in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        return self.pool.in_flight
