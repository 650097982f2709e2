"""One request through the worker groups: routing, retry before the first token, token deltas.

A request goes to the least loaded serving group. If that group fails before any token came
back (unreachable, full, crashed) the request is sent to another group; after a token it ends
with a clear error instead, since its output cannot be replayed elsewhere.

A request its group has no room for yet (Tetris: no decode instance with its KV slots free)
waits in the group's queue, oldest first, until a stats poll reports room (``room_queue.py``),
for at most the pool's ``queue_timeout_s`` (then 503); one that could never fit gets a 400 at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

import grpc

from gearshift.operator.router import errors
from gearshift.operator.router.group import Lease, WorkerGroup
from gearshift.operator.router.metrics import RouterMetrics
from gearshift.operator.router.policy_control import NeverFits
from gearshift.operator.router.pool import GroupPool
from gearshift.operator.router.room_queue import LeftGroup
from gearshift.operator.router.text import LogprobEntry, TextOptions, TextState
from gearshift.v1 import common_pb2, worker_pb2
from gearshift.worker.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_FINISH = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}
# Statuses that say "this group cannot take the request now": try another one.
_GROUP_FAILURES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.UNIMPLEMENTED,
}

# What a client is told about a worker's status (its details stay in the router's log).
_REASONS = {
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "timed out",
    grpc.StatusCode.CANCELLED: "cancelled",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "full",
    grpc.StatusCode.UNAUTHENTICATED: "refused the router's credentials",
    grpc.StatusCode.PERMISSION_DENIED: "refused the router's credentials",
}


@dataclass(frozen=True)
class PreparedRequest:
    """A tokenised, validated request, ready for a worker."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: common_pb2.SamplingParams  # worker-side parameters (no stop strings)
    text: TextOptions
    arrival_time: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class TokenDelta:
    """One output token (or, with token_id None, the end of a request without one)."""

    token_id: int | None
    text: str
    logprob: LogprobEntry | None = None
    finish_reason: str | None = None


@dataclass
class RunResult:
    """What the response needs once the deltas are consumed."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    group: str = ""
    text: str = ""
    # prompt_logprobs: one per prompt token from the second on (the worker sends them once).
    prompt_logprobs: list[LogprobEntry] = field(default_factory=list)


class RequestRun:
    """Streams the deltas of one request and keeps its result and metrics."""

    def __init__(
        self,
        pool: GroupPool,
        tokenizer: Tokenizer,
        metrics: RouterMetrics,
        request: PreparedRequest,
    ) -> None:
        self.pool = pool
        self.metrics = metrics
        self.request = request
        self.state = TextState(tokenizer, request.prompt_token_ids, request.text)
        self.result = RunResult(prompt_tokens=len(request.prompt_token_ids))
        self._first_token: float | None = None
        self._last_token: float | None = None
        self._queue_time: float | None = None
        self._recorded = False
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._cut: errors.APIError | None = None  # set by `cut`: the error the run ends with
        self._stop: asyncio.Future[None] | None = None  # done by `cut`: a wait for room ends

    def cut(self, error: errors.APIError) -> None:
        """End the run now with `error` (the drain timeout passed): its worker call is cancelled
        (so the worker frees the request) and its consumer gets `error` instead of more tokens."""
        self._cut = error
        if self._stop is not None and not self._stop.done():
            self._stop.set_result(None)
        if self._call is not None and not self._call.done():
            self._call.cancel()

    def _max_tokens(self) -> int:
        s = self.request.sampling
        if s.HasField("max_tokens"):
            return int(s.max_tokens)
        limit = self.pool.max_model_len
        return max(0, limit - len(self.request.prompt_token_ids)) if limit else 0

    async def deltas(self) -> AsyncGenerator[TokenDelta, None]:
        """Token deltas; raises APIError before the first one, or after it on a failure."""
        tried: set[str] = set()
        attempt = 0
        try:
            while True:
                lease = self.pool.acquire(
                    len(self.request.prompt_token_ids), self._max_tokens(), tried
                )
                tried.add(lease.group.name)
                self.result.group = lease.group.name
                try:
                    # aclosing: a consumer that stops early must still cancel the worker call.
                    async with contextlib.aclosing(self._attempt(lease, attempt)) as stream:
                        async for delta in stream:
                            yield delta
                    return
                except _Retry as retry:
                    if not any(g.name not in tried for g in self.pool.serving()):
                        raise retry.error from None  # no group left: not a retry
                    attempt += 1
                    self.metrics.retries.labels(self.metrics.model_name).inc()
                    log.warning(
                        "request %s: group %s failed before its first token (%s); retrying",
                        self.request.request_id,
                        lease.group.name,
                        retry,
                    )
        except errors.APIError:
            if self._first_token is None:
                # A refusal, not a finished request: the API layer counts it (rejections.py).
                self._recorded = True
            else:
                self._record("error")
            raise
        finally:
            if not self._recorded and self._first_token is not None:
                self._record("abort")  # the client went away mid-stream

    async def _attempt(self, lease: Lease, attempt: int) -> AsyncGenerator[TokenDelta, None]:
        req = self.request
        if not isinstance(lease.group, WorkerGroup):
            lease.release()
            # openai-http groups take the client's HTTP body (openai_proxy.py), not token ids.
            raise errors.APIError(
                501,
                "this deployment's backend is openai-http: send OpenAI HTTP requests",
                "not_implemented",
            )
        wire = worker_pb2.WorkerGenerateRequest(
            request_id=f"{req.request_id}-{attempt}",
            prompt_token_ids=req.prompt_token_ids,
            sampling=req.sampling,
        )
        if lease.replica is not None:
            wire.replica = lease.replica
        try:
            await self._plan(lease.group, wire)
        except BaseException:
            lease.release()
            raise
        if wire.HasField("tetris_plan"):
            self.metrics.observe_tetris_plan(wire.tetris_plan)
        if self._cut is not None:
            lease.release()
            raise self._cut
        call = self._call = lease.group.stub.Generate(wire, metadata=lease.group.metadata)
        try:
            async for response in call:
                for delta in self._on_response(lease, response):
                    yield delta
                    if delta.finish_reason is not None:
                        return
                if self._cut is not None:
                    raise self._cut
        except grpc.aio.AioRpcError as exc:
            raise (self._cut or self._classify(lease, exc)) from None
        except asyncio.CancelledError:
            # `cut` cancelled the call (not this task, which would be cancelling): its error.
            task = asyncio.current_task()
            if self._cut is not None and (task is None or not task.cancelling()):
                raise self._cut from None
            raise
        finally:
            lease.release()
            if not call.done():
                # The client left, or a stop string ended the request: the worker frees its KV.
                call.cancel()

    async def _plan(self, group: WorkerGroup, wire: worker_pb2.WorkerGenerateRequest) -> None:
        """The policy's per-request decisions (Tetris: chunk plan, decode instance). With no
        room on the group yet, the request waits in its queue (keeping its lease) for at most
        the pool's queue_timeout_s."""
        max_tokens = self._max_tokens()

        def attempt() -> None:
            group.planning.plan_into(group.stats, wire, max_tokens)

        if self._stop is None:
            self._stop = asyncio.get_running_loop().create_future()
        if self._cut is not None:
            raise self._cut
        timeout = self.pool.queue_timeout_s
        try:
            await group.room.admit(attempt, timeout, self._stop)
        except TimeoutError:
            if self._cut is not None:
                raise self._cut from None
            raise errors.APIError(
                503,
                f"group {group.name} had no room for this request within {timeout:g} s "
                "(the router's --queue-timeout; Tetris: no decode instance freed its KV "
                "slots); retry later",
                "service_unavailable",
                None,
                "queue_timeout",
                1.0,
            ) from None
        except LeftGroup as exc:
            raise _Retry(errors.unavailable(str(exc))) from None
        except NeverFits as exc:
            raise errors.APIError(
                400,
                f"group {group.name}: {exc}",
                "invalid_request_error",
                "max_tokens",
                "kv_capacity_exceeded",
            ) from exc
        except ValueError as exc:
            raise errors.unavailable(f"group {group.name}: {exc}") from exc

    def _classify(self, lease: Lease, exc: grpc.aio.AioRpcError) -> Exception:
        """The client's error for a failed worker call. The worker's own text (addresses, raw
        transport errors) goes to the log and the Admin status, never to the client."""
        code, details = exc.code(), exc.details() or exc.code().name
        group = lease.group.name
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return errors.from_worker_invalid(exc)
        log.warning(
            "request %s: group %s at %s: %s: %s",
            self.request.request_id,
            group,
            lease.group.spec.address,
            code.name,
            details,
        )
        if self._first_token is not None:
            return errors.worker_failed(
                f"worker group {group} failed after {self.result.completion_tokens} tokens "
                f"({_REASONS.get(code, 'internal error')})"
            )
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return _Retry(errors.overloaded("every worker group is full; retry later"))
        if code in _GROUP_FAILURES:
            if code == grpc.StatusCode.UNAVAILABLE:
                lease.group.mark_failed(f"{code.name}: {details}")
            return _Retry(
                errors.unavailable(
                    f"no worker group could serve the request (group {group}: "
                    f"{_REASONS.get(code, 'internal error')})"
                )
            )
        return errors.internal(f"worker group {group} failed ({_REASONS.get(code, code.name)})")

    def _on_response(
        self, lease: Lease, response: worker_pb2.WorkerGenerateResponse
    ) -> list[TokenDelta]:
        now = time.monotonic()
        n = len(response.token_ids)
        if response.HasField("timing") and self._queue_time is None:
            t = response.timing
            if t.scheduled_time and t.queued_time:
                self._queue_time = t.scheduled_time - t.queued_time
        if response.HasField("usage"):
            self.result.cached_tokens = response.usage.cached_prompt_tokens
        self.result.prompt_logprobs.extend(
            self.state.logprob(lp) for lp in response.prompt_logprobs
        )
        finish = _FINISH.get(response.finish_reason)
        if n:
            lease.on_tokens(n)
            if self._first_token is None:
                self._first_token = now
            elif self._last_token is not None:
                gap = (now - self._last_token) / n
                for _ in range(n):
                    self.metrics.itl.labels(self.metrics.model_name).observe(gap)
            self._last_token = now
        out = []
        for i, token in enumerate(response.token_ids):
            last = finish is not None and i == n - 1
            step = self.state.feed(token, last)
            self.result.completion_tokens += 1
            lp = self.state.logprob(response.logprobs[i]) if i < len(response.logprobs) else None
            reason = finish if last else None
            if step.stop_str is not None:
                reason, self.result.stop_reason = "stop", step.stop_str
            out.append(TokenDelta(token, step.text, lp, reason))
            if reason is not None:
                self._finish(reason)
                return out
        if finish is not None:
            out.append(TokenDelta(None, self.state.finish(), None, finish))
            self._finish(finish)
        return out

    def _finish(self, reason: str) -> None:
        self.result.finish_reason = reason
        self.result.text = self.state.text
        self._record(reason)

    def _record(self, reason: str) -> None:
        if self._recorded:
            return
        self._recorded = True
        now = time.monotonic()
        first = self._first_token
        self.metrics.observe_finished(
            finish_reason=reason,
            prompt_tokens=self.result.prompt_tokens,
            output_tokens=self.result.completion_tokens,
            e2e=now - self.request.arrival_time,
            ttft=first - self.request.arrival_time if first is not None else None,
            decode_time=(self._last_token - first)
            if first is not None and self._last_token is not None
            else None,
            queue_time=self._queue_time,
        )


class _Retry(Exception):
    """The group failed before the first token; `error` is the answer if no group is left."""

    def __init__(self, error: errors.APIError) -> None:
        super().__init__(error.message)
        self.error = error
