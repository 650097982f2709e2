"""The router's shared state, and a request's way from a body to a `RequestRun`."""

from __future__ import annotations

import asyncio
import time
import uuid
import weakref
from dataclasses import dataclass, field

from gearshift.operator.router import errors, request_params
from gearshift.operator.router.choices import Choices
from gearshift.operator.router.config import RouterConfig
from gearshift.operator.router.generate import PreparedRequest, RequestRun
from gearshift.operator.router.metrics import RouterMetrics
from gearshift.operator.router.pool import GroupPool
from gearshift.operator.router.request_prep import PreparedGeneration
from gearshift.worker.tokenizer import Tokenizer


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
    # Unknown field names already logged (bounded).
    ignored_fields: request_params.IgnoredFields = field(
        default_factory=request_params.IgnoredFields
    )
    # Requests not yet garbage: the drain cuts off those still running at its timeout.
    runs: weakref.WeakSet[RequestRun] = field(default_factory=weakref.WeakSet)

    @property
    def model_name(self) -> str:
        return self.config.model_name

    def check_accepting(self) -> None:
        if not self.accepting:
            raise errors.unavailable("the server is shutting down")

    # ---- requests -------------------------------------------------------------------------

    def launch(self, prepared: PreparedGeneration, prefix: str) -> tuple[str, Choices]:
        """Start a prepared request's sequences (request_prep.py checked and tokenised it).

        Returns the response id (the client's request_id when given, as vLLM does) and the
        running choices, `best_of` (or `n`) per prompt in prompt order; closing them frees
        the id.
        """
        body, prompts = prepared.body, prepared.prompts
        self.check_accepting()  # a drain may have begun while it was prepared
        self.ignored_fields.note(body)
        rid = body.request_id or f"{prefix}-{uuid.uuid4().hex}"
        self.claim_id(rid)
        count = body.num_sequences
        runs = [
            self.run(
                PreparedRequest(
                    request_id=rid if count * len(prompts) == 1 else f"{rid}-{k}-{i}",
                    prompt_token_ids=ids,
                    sampling=request_params.child_sampling(prepared.sampling, i),
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
