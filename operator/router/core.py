"""The router's shared state, and a request's way from a body to a `RequestRun`."""

from __future__ import annotations

import asyncio
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any

from gearshift.operator.router import errors
from gearshift.operator.router.config import RouterConfig
from gearshift.operator.router.generate import PreparedRequest, RequestRun
from gearshift.operator.router.metrics import RouterMetrics
from gearshift.operator.router.pool import GroupPool
from gearshift.operator.router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
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

    # ---- prompts --------------------------------------------------------------------------

    def completion_prompt(self, req: CompletionRequest) -> list[int]:
        prompt: str | list[Any] = req.prompt
        if prompt and isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise errors.bad_request(
                    "only one prompt per request is supported; send one request per prompt",
                    "prompt",
                )
            prompt = prompt[0]
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise errors.bad_request("the prompt is empty", "prompt")
        return ids

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        if not req.messages:
            raise errors.bad_request("messages must not be empty", "messages")
        try:
            return self.tokenizer.apply_chat_template(
                req.messages,
                add_generation_prompt=req.add_generation_prompt,
                tools=req.tools,
                **(req.chat_template_kwargs or {}),
            )
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

    def prepare(
        self,
        req: SamplingFields,
        ids: list[int],
        max_tokens: int | None,
        logprobs: int | None,
        prompt_param: str,
        prefix: str,
    ) -> PreparedRequest:
        self.check_accepting()
        self.check_model(req.model)
        self.check_length(ids, max_tokens, prompt_param)
        return PreparedRequest(
            request_id=f"{prefix}-{uuid.uuid4().hex}",
            prompt_token_ids=ids,
            sampling=req.sampling(max_tokens, logprobs),
            text=req.text_options(),
        )

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
