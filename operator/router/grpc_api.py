"""`gearshift.v1.Generation`: the gRPC twin of /v1/completions (router.proto)."""

from __future__ import annotations

import contextlib
import hmac
import uuid
from collections.abc import AsyncIterator

import grpc

from gearshift.operator.router import errors
from gearshift.operator.router.core import Router
from gearshift.operator.router.generate import PreparedRequest
from gearshift.operator.router.text import LogprobEntry, TextOptions
from gearshift.v1 import common_pb2, router_pb2, router_pb2_grpc

_FINISH = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "error": common_pb2.FINISH_REASON_ERROR,
}


class GenerationService(router_pb2_grpc.GenerationServicer):
    """Generate over the same routing, retry and detokenisation as the HTTP API."""

    def __init__(self, router: Router) -> None:
        self.router = router

    async def _check_key(self, context: grpc.aio.ServicerContext) -> None:
        keys = self.router.config.api_keys
        if not keys:
            return
        header = dict(context.invocation_metadata() or ()).get("authorization", "")
        scheme, _, token = str(header).partition(" ")
        if scheme.lower() != "bearer" or not any(
            hmac.compare_digest(token.strip().encode(), k.encode()) for k in keys
        ):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "incorrect API key provided")

    async def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        await self._check_key(context)
        router = self.router
        try:
            router.check_accepting()
            router.check_model(request.model or None)
            if bool(request.prompt) == bool(request.prompt_token_ids):
                raise errors.bad_request("set exactly one of prompt and prompt_token_ids")
            ids = (
                router.tokenizer.encode(request.prompt)
                if request.prompt
                else list(request.prompt_token_ids)
            )
            s = request.sampling
            max_tokens = s.max_tokens if s.HasField("max_tokens") else None
            router.check_length(ids, max_tokens, "prompt")
            sampling = common_pb2.SamplingParams()
            sampling.CopyFrom(s)
            del sampling.stop[:]  # stop strings are checked here, on the detokenised text
            text = TextOptions(
                stop=tuple(s.stop),
                include_stop_str_in_output=s.include_stop_str_in_output,
                skip_special_tokens=not s.HasField("skip_special_tokens") or s.skip_special_tokens,
                min_tokens=s.min_tokens,
            )
            rid = request.request_id or f"gen-{uuid.uuid4().hex}"
            run = router.run(PreparedRequest(rid, ids, sampling, text))
            whole = router_pb2.GenerateResponse(request_id=rid)
            async with contextlib.aclosing(run.deltas()) as deltas:
                async for d in deltas:
                    out = router_pb2.GenerateResponse(request_id=rid) if request.stream else whole
                    out.text += d.text
                    if d.token_id is not None:
                        out.token_ids.append(d.token_id)
                    if d.logprob is not None:
                        out.logprobs.append(_logprob(d.logprob))
                    if d.finish_reason is not None:
                        r = run.result
                        out.finish_reason = _FINISH[d.finish_reason]
                        out.usage.prompt_tokens = r.prompt_tokens
                        out.usage.completion_tokens = r.completion_tokens
                        out.usage.cached_prompt_tokens = r.cached_tokens
                        out.group = r.group
                    if request.stream:
                        yield out
            if not request.stream:
                yield whole
        except errors.APIError as exc:
            await context.abort(exc.grpc_code, exc.message)


def _logprob(entry: LogprobEntry) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=entry.token_id,
        logprob=entry.logprob,
        token=entry.token,
        top_logprobs=[
            common_pb2.TopLogprob(token_id=t.token_id, logprob=t.logprob, token=t.token)
            for t in entry.top
        ],
    )
