"""The operator's client of the router's Admin gRPC API (router.proto).

Every call opens a short-lived channel and has a deadline, so an unreachable router costs a
reconcile pass a bounded wait and never blocks kopf.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from gearshift.v1 import policy_pb2, router_pb2, router_pb2_grpc
from gearshift.worker.server import auth


class AdminUnavailable(RuntimeError):
    """The router's Admin API did not answer (not started, not ready, or wrong address)."""


@dataclass(frozen=True)
class AdminClient:
    """Calls Admin at `address` ("host:port") with a per-call deadline."""

    address: str
    timeout_seconds: float = 3.0
    # The deployment's admin token (worker/server/auth.py), with the one it replaced in the
    # grace window after a rotation (tokens.py).
    token: str | auth.TokenSource | None = None

    @property
    def _metadata(self) -> auth.Metadata | None:
        return auth.call_metadata(self.token)

    async def get_status(self) -> router_pb2.RouterStatus:
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = router_pb2_grpc.AdminStub(channel)
            try:
                return await stub.GetStatus(
                    router_pb2.GetStatusRequest(),
                    timeout=self.timeout_seconds,
                    metadata=self._metadata,
                )
            except grpc.aio.AioRpcError as exc:
                raise AdminUnavailable(
                    f"{self.address}: {exc.code().name} {exc.details()}"
                ) from exc

    async def apply_policy(
        self, policy: policy_pb2.Policy, group: str = ""
    ) -> router_pb2.AdminApplyPolicyResponse:
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = router_pb2_grpc.AdminStub(channel)
            request = router_pb2.AdminApplyPolicyRequest(group=group, policy=policy)
            try:
                return await stub.ApplyPolicy(
                    request, timeout=self.timeout_seconds, metadata=self._metadata
                )
            except grpc.aio.AioRpcError as exc:
                raise AdminUnavailable(
                    f"{self.address}: {exc.code().name} {exc.details()}"
                ) from exc

    async def drain(self, group: str, resume: bool = False) -> int:
        """Stop (or resume) routing to `group`; returns its requests still in flight."""
        async with grpc.aio.insecure_channel(self.address) as channel:
            stub = router_pb2_grpc.AdminStub(channel)
            request = router_pb2.DrainRequest(group=group, resume=resume)
            try:
                response = await stub.Drain(
                    request, timeout=self.timeout_seconds, metadata=self._metadata
                )
            except grpc.aio.AioRpcError as exc:
                raise AdminUnavailable(
                    f"{self.address}: {exc.code().name} {exc.details()}"
                ) from exc
            return int(response.in_flight)
