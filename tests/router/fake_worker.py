"""A scripted stand-in for a worker group's gRPC server, for router tests without a model."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gearshift.v1 import common_pb2, policy_pb2, worker_pb2, worker_pb2_grpc
from gearshift.worker.server import auth


@dataclass
class Script:
    """What the fake does with the next Generate calls."""

    tokens: list[int] = field(default_factory=list)
    finish: int = common_pb2.FINISH_REASON_LENGTH
    delay_s: float = 0.0
    fail_before_first: grpc.StatusCode | None = None
    fail_after: int | None = None  # tokens, then INTERNAL
    invalid_param: str | None = None


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(self, name: str, max_model_len: int = 512, token: str | None = None) -> None:
        self.name = name
        self.token = token  # required on Worker calls, like a real worker (auth.py)
        self.script = Script()
        self.max_model_len = max_model_len
        self.requests: list[worker_pb2.WorkerGenerateRequest] = []
        self.cancelled: list[str] = []
        self.threshold = 256
        # Load reported beyond the router's own requests: the group's, and per engine replica
        # (a non-empty list makes this a replica group, as a SiDP worker reports itself).
        self.outstanding = 0
        self.replica_outstanding: list[int] = []
        # A policy to report instead of shift's, and per-instance loads (a tetris group).
        self.policy: policy_pb2.Policy | None = None
        self.instances: list[worker_pb2.InstanceStats] = []
        self.server: grpc.aio.Server | None = None
        self.port = 0

    async def start(self) -> FakeWorker:
        self.server = grpc.aio.server(
            interceptors=auth.interceptors(self.token, self.name, self.token is None)
        )
        worker_pb2_grpc.add_WorkerServicer_to_server(self, self.server)
        self.health = health.aio.HealthServicer()
        await self.health.set("gearshift.v1.Worker", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return self

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=None)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def Generate(
        self, request: worker_pb2.WorkerGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.WorkerGenerateResponse]:
        self.requests.append(request)
        s = self.script
        if s.invalid_param:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{s.invalid_param} is bad",
                trailing_metadata=(("gearshift-param", s.invalid_param),),
            )
        if s.fail_before_first is not None:
            await context.abort(s.fail_before_first, "scripted failure")
        try:
            for i, token in enumerate(s.tokens):
                if s.fail_after is not None and i == s.fail_after:
                    await context.abort(grpc.StatusCode.INTERNAL, "scripted crash")
                await asyncio.sleep(s.delay_s)
                last = i == len(s.tokens) - 1
                yield worker_pb2.WorkerGenerateResponse(
                    request_id=request.request_id,
                    token_ids=[token],
                    finish_reason=s.finish if last else common_pb2.FINISH_REASON_UNSPECIFIED,
                    usage=common_pb2.Usage(
                        prompt_tokens=len(request.prompt_token_ids), completion_tokens=i + 1
                    ),
                )
        except (asyncio.CancelledError, GeneratorExit):
            # A cancelled call ends the generator either inside the sleep (CancelledError) or
            # while it is suspended at a yield (GeneratorExit, when grpc closes it).
            self.cancelled.append(request.request_id)
            raise

    async def GetStats(
        self, request: worker_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerStats:
        stats = worker_pb2.WorkerStats(
            model="fake",
            max_model_len=self.max_model_len,
            gear="shift",
            outstanding_tokens=self.outstanding + sum(self.replica_outstanding),
            policy=policy_pb2.Policy(
                shift=policy_pb2.ShiftPolicy(sp=1, tp=1, threshold=self.threshold)
            ),
        )
        for index, tokens in enumerate(self.replica_outstanding):
            stats.replicas.add(index=index, outstanding_tokens=tokens)
        if self.policy is not None:
            stats.policy.CopyFrom(self.policy)
        stats.instances.extend(self.instances)
        return stats

    async def ApplyPolicy(
        self, request: worker_pb2.ApplyPolicyRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.ApplyPolicyResponse:
        if request.policy.shift.HasField("sp"):
            return worker_pb2.ApplyPolicyResponse(applied=False, message="shift.sp is not live")
        self.threshold = request.policy.shift.threshold
        return worker_pb2.ApplyPolicyResponse(applied=True)
