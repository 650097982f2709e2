"""`gearshift.v1.Worker` over grpc.aio: Generate streams, Abort, GetStats, ApplyPolicy."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from gearshift.v1 import worker_pb2, worker_pb2_grpc
from gearshift.worker.engine.outputs import RequestOutput
from gearshift.worker.engine.sequence import FinishReason
from gearshift.worker.errors import GroupFailure, InvalidRequestError
from gearshift.worker.sampling.params import InvalidSamplingParams
from gearshift.worker.server import convert
from gearshift.worker.server.engine_loop import EngineStopped
from gearshift.worker.server.handle import REQUEST_PLAN_FIELDS, EngineHandle

log = logging.getLogger(__name__)

# Marks an ApplyPolicy call as a router controller's decision (operator/router/policy_control.py).
DECISION_METADATA_KEY = "gearshift-controller-decision"


def _is_decision(context: grpc.aio.ServicerContext) -> bool:
    return any(
        k == DECISION_METADATA_KEY and v == "1" for k, v in (context.invocation_metadata() or ())
    )


# Trailing metadata key naming the offending request field of an INVALID_ARGUMENT status.
PARAM_METADATA_KEY = "gearshift-param"


@dataclass(frozen=True)
class WorkerInfo:
    """What GetStats reports besides the engine's own counters."""

    model: str
    max_model_len: int
    ranks: int
    revision: str
    max_requests: int  # in flight (running + waiting) before RESOURCE_EXHAUSTED


class WorkerService(worker_pb2_grpc.WorkerServicer):
    """Serves one engine loop; every request is a queue fed from the engine thread.

    Registered before the model loads (a gRPC server takes no services once started) and
    answers UNAVAILABLE until `attach` hands it the running engine loop.
    """

    def __init__(self) -> None:
        self._engine: EngineHandle | None = None
        self._info: WorkerInfo | None = None
        self.clock = convert.Clock.now()
        self.active: set[str] = set()
        self.admitting = True  # False once the pod is stopping (preStop's SIGUSR1, SIGTERM)
        # Abort calls in flight (referenced until done: a bare task may be collected).
        self._aborts: set[asyncio.Future[bool]] = set()

    def attach(self, engine: EngineHandle, info: WorkerInfo) -> None:
        self._engine, self._info = engine, info

    @property
    def engine(self) -> EngineHandle:
        assert self._engine is not None
        return self._engine

    @property
    def info(self) -> WorkerInfo:
        assert self._info is not None
        return self._info

    async def _check_ready(self, context: grpc.aio.ServicerContext) -> None:
        if self._engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is loading its model")

    async def Generate(
        self, request: worker_pb2.WorkerGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
        await self._check_ready(context)
        rid = request.request_id
        if self.engine.dead is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.engine.dead)
        if not self.admitting:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is shutting down")
        if not rid:
            await _invalid(context, "request_id", "request_id is empty")
        if rid in self.active:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} is running")
        if len(self.active) >= self.info.max_requests:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{len(self.active)} requests in flight, the limit is {self.info.max_requests}",
            )
        replica = request.replica if request.HasField("replica") else None
        if replica is not None and replica >= self.engine.replicas:
            await _invalid(
                context,
                "replica",
                f"replica {replica} does not exist: this group runs {self.engine.replicas} "
                "engine replica(s), numbered from 0",
            )
        plan = None
        for name in REQUEST_PLAN_FIELDS:
            if not request.HasField(name):
                continue
            if name != self.engine.plan_field:
                await _invalid(context, name, f"{name}: this group's policy takes no such plan")
            plan = getattr(request, name)
        try:
            params = convert.sampling_params(request.sampling)
        except InvalidSamplingParams as exc:
            await _invalid(context, exc.field, str(exc))
        # The engine loop delivers on this event loop (deliver_on), so a plain put is safe.
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        sink = outputs.put_nowait
        self.active.add(rid)
        finished = False
        try:
            self.engine.submit(
                rid, list(request.prompt_token_ids), params, sink, time.monotonic(), replica, plan
            )
            first = True
            while not finished:
                batch = [await outputs.get()]
                while not outputs.empty():  # coalesce what queued up while we were sending
                    batch.append(outputs.get_nowait())
                failure = next((b for b in batch if isinstance(b, BaseException)), None)
                done = [b for b in batch if isinstance(b, RequestOutput)]
                if failure is not None:
                    finished = True
                    await _fail(context, failure)
                last = done[-1]
                finished = last.finished
                if last.finish_reason is FinishReason.ERROR:
                    if any(o.new_token_ids for o in done):
                        yield convert.merge_outputs(done, self.clock, first)
                    await context.abort(grpc.StatusCode.INTERNAL, last.error or "request failed")
                yield convert.merge_outputs(done, self.clock, first)
                first = False
        finally:
            self.active.discard(rid)
            if not finished:
                # The client went away (or the stream broke): free the request's KV blocks.
                task = asyncio.ensure_future(self.engine.abort(rid))
                self._aborts.add(task)
                task.add_done_callback(self._aborts.discard)

    async def Abort(
        self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.AbortResponse:
        await self._check_ready(context)
        found = await self.engine.abort(request.request_id)
        return worker_pb2.AbortResponse(found=found)

    async def GetStats(
        self, request: worker_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerStats:
        await self._check_ready(context)
        out = convert.worker_stats(
            self.engine.snapshot,
            model=self.info.model,
            max_model_len=self.info.max_model_len,
            policy=self.engine.policy,
            ranks=self.info.ranks,
            revision=self.info.revision,
        )
        extra = self.engine.stats_extra
        if extra is not None:
            out.MergeFrom(extra)
        return out

    async def ApplyPolicy(
        self, request: worker_pb2.ApplyPolicyRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ApplyPolicyResponse:
        await self._check_ready(context)
        try:
            values = convert.live_update(self.engine.policy, request.policy)
            if _is_decision(context):
                # A router-side controller's decision (operator/router/policy_control.py): the
                # group acts on it; the configured policy stays as it is.
                decide = getattr(self.engine, "apply_decision", None)
                if decide is None:
                    raise InvalidRequestError(
                        "policy", "this group's engine takes no controller decisions"
                    )
                await decide(values)
                log.info("applied a controller decision %s", values)
            elif values:
                await self.engine.apply_live(values)
                log.info("applied live policy parameters %s", values)
        except InvalidRequestError as exc:
            return worker_pb2.ApplyPolicyResponse(
                applied=False, message=exc.message, policy=self.engine.policy
            )
        except EngineStopped as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return worker_pb2.ApplyPolicyResponse(applied=True, policy=self.engine.policy)

    async def ProfileTetris(
        self, request: worker_pb2.ProfileTetrisRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ProfileTetrisResponse:
        await self._check_ready(context)
        profile: Any = getattr(self.engine, "profile_tetris", None)
        if profile is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"ProfileTetris: this group runs the {self.engine.policy.WhichOneof('kind')} "
                "policy; only a tetris group has a prefill pool to profile",
            )
        try:
            samples = await profile(
                list(request.sp_sizes),
                list(request.histories),
                list(request.lengths),
                request.repeats,
            )
        except InvalidRequestError as exc:
            await _invalid(context, exc.field, exc.message)
        except (GroupFailure, EngineStopped) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        out = worker_pb2.ProfileTetrisResponse()
        for sp, history, length, seconds in samples:
            out.samples.add(sp=sp, history=history, length=length, seconds=seconds)
        return out


async def _invalid(context: grpc.aio.ServicerContext, field: str, message: str) -> None:
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT, message, trailing_metadata=((PARAM_METADATA_KEY, field),)
    )


async def _fail(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End a Generate stream with the status that says who is at fault."""
    if isinstance(exc, InvalidRequestError):
        await _invalid(context, exc.field, exc.message)
    if isinstance(exc, InvalidSamplingParams):
        await _invalid(context, exc.field, str(exc))
    if isinstance(exc, (GroupFailure, EngineStopped)):
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
    log.error("request failed: %s", exc)
    await context.abort(grpc.StatusCode.INTERNAL, str(exc) or type(exc).__name__)
