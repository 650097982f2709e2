"""A request's way from the wire to its started sequences: admission, body, lane, start.

Every client route that tokenises comes through here (``/v1/completions``,
``/v1/chat/completions``, ``/tokenize``, ``/detokenize``, gRPC ``Generate``, and the bodies the
openai-http proxy forwards). The order is what keeps one request from taking the router:

1. admission, on the event loop and before the body is read: draining (503), every serving
   group full (429);
2. the body, capped by the ``BodyLimit`` middleware (413);
3. the CPU work (parsing, size caps, validation, template, grammar, tokens: request_prep.py)
   in a bounded preparation lane off the loop (lanes.py; 429 when the lane is full);
4. starting the sequences, on the loop (``Router.launch``).
"""

from __future__ import annotations

import email.message
import time

from starlette.requests import Request

from gearshift.operator.router import errors, request_prep
from gearshift.operator.router.chat_render import ChatView
from gearshift.operator.router.choices import Choices
from gearshift.operator.router.completion_render import CompletionView
from gearshift.operator.router.core import Router
from gearshift.operator.router.lanes import PreparationLanes
from gearshift.operator.router.protocol import ChatCompletionRequest, CompletionRequest
from gearshift.operator.router.request_prep import PreparedGenerate, PrepContext, ProxyPlan
from gearshift.v1 import router_pb2


async def read_body(request: Request) -> bytes:
    """The body of a JSON route (FastAPI's rule: no content type, or a JSON one)."""
    content_type = request.headers.get("content-type")
    if content_type:
        message = email.message.Message()
        message["content-type"] = content_type
        subtype = message.get_content_subtype()
        if message.get_content_maintype() != "application" or not (
            subtype == "json" or subtype.endswith("+json")
        ):
            raise errors.bad_request(
                f"the request body must be JSON (content-type application/json), got "
                f"{errors.clip(content_type, 60)}"
            )
    return await request.body()


class Preparation:
    """Prepares the requests of one router in its lanes."""

    def __init__(self, router: Router, lanes: PreparationLanes) -> None:
        self.router = router
        self.lanes = lanes

    def context(self) -> PrepContext:
        """The router's state a preparation reads (a snapshot: it may run in a process)."""
        router = self.router
        return PrepContext(router.model_name, router.pool.max_model_len, router.config.limits)

    def admit(self) -> None:
        """Refuse before any work: draining, every serving group full."""
        self.router.check_accepting()
        self.router.pool.check_admission()

    # ---- HTTP ------------------------------------------------------------------------------

    async def completion(self, request: Request) -> tuple[CompletionView, Choices, bool]:
        """The view, started choices and `stream` of a /v1/completions request."""
        self.admit()
        raw = await read_body(request)
        p = await self.lanes.run(len(raw), request_prep.completion, raw, self.context())
        body = p.body
        assert isinstance(body, CompletionRequest)
        rid, choices = self.router.launch(p, "cmpl")
        view = CompletionView(
            rid,
            int(time.time()),
            self.router.model_name,
            body.n,
            p.echo,
            body.logprobs is not None,
            body.include_usage,
            body.continuous_usage,
            body.prompt_logprobs is not None,
            p.first,
        )
        return view, choices, body.stream

    async def chat(self, request: Request) -> tuple[ChatView, Choices, bool]:
        """The view, started choices and `stream` of a /v1/chat/completions request."""
        self.admit()
        raw = await read_body(request)
        p = await self.lanes.run(len(raw), request_prep.chat, raw, self.context())
        body = p.body
        assert isinstance(body, ChatCompletionRequest)
        rid, choices = self.router.launch(p, "chatcmpl")
        view = ChatView(
            rid,
            int(time.time()),
            self.router.model_name,
            body.logprobs,
            body.include_usage,
            body.continuous_usage,
            p.tools,
            body.prompt_logprobs is not None,
        )
        return view, choices, body.stream

    async def tokenize(self, request: Request) -> bytes:
        """The /tokenize answer (JSON); the router's own tokenizer, no group needed."""
        raw = await read_body(request)
        return await self.lanes.run(len(raw), request_prep.tokenize, raw, self.context())

    async def detokenize(self, request: Request) -> bytes:
        """The /detokenize answer (JSON)."""
        raw = await read_body(request)
        return await self.lanes.run(len(raw), request_prep.detokenize, raw, self.context())

    async def proxied(self, request: Request) -> ProxyPlan:
        """A body for an openai-http group: admitted, checked, its prompt counted."""
        self.admit()
        raw = await request.body()  # the backend judges the content type
        return await self.lanes.run(len(raw), request_prep.proxied, raw, self.context())

    # ---- gRPC ------------------------------------------------------------------------------

    async def generation(self, request: router_pb2.GenerateRequest) -> PreparedGenerate:
        """A Generate request's prompt ids, worker sampling parameters and text options."""
        self.admit()
        size = request.ByteSize()
        return await self.lanes.run(size, request_prep.generate, request, self.context())
