"""`gearshift.v1.Admin`: live policy changes, each group's status, draining (router.proto)."""

from __future__ import annotations

import asyncio
import logging

import grpc

from gearshift.operator.router.core import Router
from gearshift.operator.router.group import Group, WorkerGroup
from gearshift.operator.router.traffic_window import LengthSummary
from gearshift.v1 import (
    policy_fields,
    policy_pb2,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
)

log = logging.getLogger(__name__)


class AdminService(router_pb2_grpc.AdminServicer):
    """What the operator (and people) call, with the deployment's control token (auth.py)."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def _targets(self, name: str) -> list[Group]:
        groups = list(self.router.pool.groups.values())
        return [g for g in groups if g.name == name] if name else groups

    async def ApplyPolicy(
        self, request: router_pb2.AdminApplyPolicyRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.AdminApplyPolicyResponse:
        targets = self._targets(request.group)
        if request.group and not targets:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no group named {request.group!r}")
        if not policy_fields.kind_of(request.policy):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "policy: no policy kind is set")
        results = await asyncio.gather(*(self._apply(g, request.policy) for g in targets))
        applied = bool(results) and all(r.applied for r in results)
        return router_pb2.AdminApplyPolicyResponse(applied=applied, results=results)

    async def _apply(self, group: Group, policy: policy_pb2.Policy) -> router_pb2.GroupApplyResult:
        if not isinstance(group, WorkerGroup):
            return router_pb2.GroupApplyResult(
                group=group.name, applied=False, message="an openai-http group has no live policy"
            )
        try:
            response = await group.stub.ApplyPolicy(
                worker_pb2.ApplyPolicyRequest(policy=policy),
                timeout=group.rpc_timeout_s,
                metadata=group.metadata,
            )
        except grpc.aio.AioRpcError as exc:
            return router_pb2.GroupApplyResult(
                group=group.name, applied=False, message=f"{exc.code().name}: {exc.details()}"
            )
        if response.applied:
            log.info("group %s: policy applied", group.name)
            await group.poll()  # GetStatus and /metrics show the new values at once
        return router_pb2.GroupApplyResult(
            group=group.name,
            applied=response.applied,
            message=response.message,
            policy=response.policy,
        )

    async def GetStatus(
        self, request: router_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.RouterStatus:
        out = router_pb2.RouterStatus(model=self.router.model_name)
        for g in self.router.pool.groups.values():
            status = out.groups.add(
                name=g.name,
                address=g.spec.address,
                serving=g.serving,
                draining=g.draining,
                message=g.message,
            )
            if g.stats is not None:
                status.gear = g.stats.gear
                status.policy.CopyFrom(g.stats.policy)
                status.stats.CopyFrom(g.stats)
        window = self.router.metrics.window
        seen = window.summary()
        out.traffic.CopyFrom(
            router_pb2.ObservedTraffic(
                requests=seen.requests,
                window_seconds=seen.window_s,
                rate=seen.rate,
                burstiness=seen.burstiness,
                prompt_tokens=_lengths(seen.prompt),
                output_tokens=_lengths(seen.output),
                max_requests=window.max_requests,
                max_age_seconds=window.max_age_s,
            )
        )
        return out

    async def Drain(
        self, request: router_pb2.DrainRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.DrainResponse:
        group = self.router.pool.get(request.group)
        if group is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no group named {request.group!r}")
        assert group is not None
        group.draining = not request.resume
        log.info("group %s %s", group.name, "resumed" if request.resume else "draining")
        return router_pb2.DrainResponse(in_flight=group.load.in_flight)


def _lengths(summary: LengthSummary) -> router_pb2.LengthSummary:
    return router_pb2.LengthSummary(
        median=summary.median, p90=summary.p90, min=summary.low, max=summary.high
    )
