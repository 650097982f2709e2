"""A request's preparation, in one place: from a parsed body to its token ids and checks.

Every client route that tokenises comes through here (``/v1/completions``,
``/v1/chat/completions``, ``/tokenize``, ``/detokenize`` and gRPC ``Generate``). Each request's
work for the tokenizer (the body's text check, chat template, encoding, echo) is one call,
run by ``_work``; starting the request's sequences stays on the event loop
(``Router.start``). The work runs inline today, so a long prompt holds the loop while it is
tokenised; bounding it (sizes, a pool of its own) is a change to this module alone.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

from gearshift.operator.router import errors, request_params
from gearshift.operator.router.chat_render import ChatView
from gearshift.operator.router.choices import Choices
from gearshift.operator.router.completion_render import CompletionView
from gearshift.operator.router.core import Router
from gearshift.operator.router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from gearshift.operator.router.structured_request import structured_spec
from gearshift.operator.router.text import TextOptions
from gearshift.operator.router.tool_calls import ToolPlan
from gearshift.v1 import common_pb2, router_pb2

T = TypeVar("T")


class Preparation:
    """Prepares the requests of one router (its tokenizer, its groups' context length)."""

    def __init__(self, router: Router) -> None:
        self.router = router

    async def _work(self, work: Callable[[], T]) -> T:
        """Run one request's tokenizer work (the one place that may bound or move it)."""
        return work()

    # ---- HTTP ------------------------------------------------------------------------------

    async def completion(self, body: CompletionRequest) -> tuple[CompletionView, Choices]:
        """Checks, prompts and the started choices of a /v1/completions request."""
        prompts, echo, first = await self._work(functools.partial(self._completion, body))
        rid, choices = self.router.start(
            body, prompts, body.max_tokens, body.logprobs, "prompt", "cmpl"
        )
        view = CompletionView(
            rid,
            int(time.time()),
            self.router.model_name,
            body.n,
            echo,
            body.logprobs is not None,
            body.include_usage,
            body.continuous_usage,
            body.prompt_logprobs is not None,
            first,
        )
        return view, choices

    def _admit(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        """The checks every generation request passes before its prompt is tokenised."""
        self.router.check_text(body)
        self.router.check_accepting()
        self.router.check_model(body.model)

    def _completion(
        self, body: CompletionRequest
    ) -> tuple[list[list[int]], tuple[str, ...], tuple[str, ...]]:
        router, tokenizer = self.router, self.router.tokenizer
        self._admit(body)
        if body.suffix:
            raise errors.bad_request("suffix is not supported", "suffix")
        prompts = router.completion_prompts(body)
        echo = tuple(tokenizer.decode(ids) if body.echo else "" for ids in prompts)
        first = tuple(tokenizer.decode(ids[:1], skip_special_tokens=False) for ids in prompts)
        return prompts, echo, first

    async def chat(self, body: ChatCompletionRequest) -> tuple[ChatView, Choices]:
        """Checks, prompt and the started choices of a /v1/chat/completions request."""
        ids, tools = await self._work(functools.partial(self._chat, body))
        rid, choices = self.router.start(
            body, [ids], body.output_limit, body.num_logprobs, "messages", "chatcmpl"
        )
        view = ChatView(
            rid,
            int(time.time()),
            self.router.model_name,
            body.logprobs,
            body.include_usage,
            body.continuous_usage,
            tools,
            body.prompt_logprobs is not None,
        )
        return view, choices

    def _chat(self, body: ChatCompletionRequest) -> tuple[list[int], ToolPlan | None]:
        self._admit(body)
        _, tools = structured_spec(body)  # 400s about tools before the template sees them
        if body.stream and body.prompt_logprobs is not None:
            # Whole chat responses carry them (on the response, as vLLM does); streams do not.
            raise errors.bad_request(
                "prompt_logprobs: not available on streamed chat completions; drop stream or "
                "prompt_logprobs",
                "prompt_logprobs",
            )
        return self.router.chat_prompt(body), tools

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """The /tokenize answer."""
        return await self._work(functools.partial(self._tokenize, body))

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        """The /detokenize answer."""
        return await self._work(functools.partial(self._detokenize, body))

    def _tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        router, tokenizer = self.router, self.router.tokenizer
        router.check_text(body)
        router.check_model(body.model)
        if body.messages is not None:
            chat = ChatCompletionRequest.model_validate(
                {"messages": body.messages, "add_generation_prompt": body.add_generation_prompt}
            )
            ids = router.chat_prompt(chat)
        elif body.prompt is not None:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise errors.bad_request("one of prompt and messages is required", "prompt")
        strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": router.pool.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    def _detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        tokenizer = self.router.tokenizer
        self.router.check_text(body)
        self.router.check_model(body.model)
        if any(t < 0 or t >= tokenizer.vocab_size for t in body.tokens):
            raise errors.bad_request("a token id is outside the vocabulary", "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    # ---- gRPC ------------------------------------------------------------------------------

    async def generation(
        self, request: router_pb2.GenerateRequest
    ) -> tuple[list[int], common_pb2.SamplingParams, TextOptions]:
        """A Generate request's prompt ids, worker sampling parameters and text options."""
        return await self._work(functools.partial(self._generation, request))

    def _generation(
        self, request: router_pb2.GenerateRequest
    ) -> tuple[list[int], common_pb2.SamplingParams, TextOptions]:
        router = self.router
        router.check_accepting()
        router.check_model(request.model or None)
        if bool(request.prompt) == bool(request.prompt_token_ids):
            raise errors.bad_request("set exactly one of prompt and prompt_token_ids")
        if request.prompt:
            ids = router.tokenizer.encode(request.prompt)
        else:
            ids = list(request.prompt_token_ids)
            request_params.check_token_ids(ids, router.tokenizer.vocab_size, "prompt_token_ids")
        s = request.sampling
        max_tokens = s.max_tokens if s.HasField("max_tokens") else None
        router.check_length(ids, max_tokens, "prompt")
        request_params.check_proto_sampling(
            s, router.tokenizer, len(ids), router.pool.max_model_len
        )
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(s)
        del sampling.stop[:]  # stop strings are checked here, on the detokenised text
        text = TextOptions(
            stop=tuple(s.stop),
            include_stop_str_in_output=s.include_stop_str_in_output,
            skip_special_tokens=not s.HasField("skip_special_tokens") or s.skip_special_tokens,
            min_tokens=s.min_tokens,
        )
        return ids, sampling, text
