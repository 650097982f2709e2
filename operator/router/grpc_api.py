"""`gearshift.v1.Generation`: the gRPC twin of /v1/completions (router.proto)."""

from __future__ import annotations

import contextlib
import hmac
import uuid
from collections.abc import AsyncIterator

import grpc

from gearshift.operator.router import errors
from gearshift.operator.router.core import Router
from gearshift.operator.router.generate import PreparedRequest, RequestRun
from gearshift.operator.router.preparation import Preparation
from gearshift.operator.router.rejections import count_grpc
from gearshift.operator.router.text import LogprobEntry
from gearshift.v1 import common_pb2, router_pb2, router_pb2_grpc

_FINISH = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "error": common_pb2.FINISH_REASON_ERROR,
}


class GenerationService(router_pb2_grpc.GenerationServicer):
    """Generate over the same routing, retry and detokenisation as the HTTP API."""

    def __init__(self, router: Router, preparation: Preparation) -> None:
        self.router = router
        self.preparation = preparation

    async def _check_key(self, context: grpc.aio.ServicerContext) -> None:
        keys = self.router.config.api_keys
        if not keys:
            return
        header = dict(context.invocation_metadata() or ()).get("authorization", "")
        scheme, _, token = str(header).partition(" ")
        if scheme.lower() != "bearer" or not any(
            hmac.compare_digest(token.strip().encode(), k.encode()) for k in keys
        ):
            count_grpc(self.router.metrics, errors.unauthorized())
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "incorrect API key provided")

    async def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        await self._check_key(context)
        router = self.router
        run: RequestRun | None = None
        claimed: str | None = None
        try:
            p = await self.preparation.generation(request)
            router.check_accepting()  # a drain may have begun while it was prepared
            rid = request.request_id or f"gen-{uuid.uuid4().hex}"
            router.claim_id(rid)
            claimed = rid
            run = router.run(PreparedRequest(rid, p.prompt_token_ids, p.sampling, p.text))
            whole = router_pb2.GenerateResponse(request_id=rid)
            async with contextlib.aclosing(run.deltas()) as deltas:
                first = True
                async for d in deltas:
                    out = router_pb2.GenerateResponse(request_id=rid) if request.stream else whole
                    if first:
                        out.prompt_logprobs.extend(_logprob(e) for e in run.result.prompt_logprobs)
                        first = False
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
            if run is None or run.result.completion_tokens == 0:
                # Refused before any token; a failure mid-stream is a finished "error" request.
                count_grpc(router.metrics, exc)
            await context.abort(exc.grpc_code, exc.message)
        finally:
            if claimed is not None:
                router.active_ids.discard(claimed)


def _logprob(entry: LogprobEntry) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=entry.token_id,
        logprob=entry.logprob,
        token=entry.token,
        rank=entry.rank,
        top_logprobs=[
            common_pb2.TopLogprob(token_id=t.token_id, logprob=t.logprob, token=t.token)
            for t in entry.top
        ],
    )
