"""The leader's control messages to the other ranks: step plans, keep-alives, shutdown, and
requests to time the group's collectives (``gearshift profile``, parallel/collective_timing.py).

Messages go over a gloo group on every platform (DESIGN.md) as a fixed-size int64 header plus,
for a step, the plan's packed body: two small broadcasts per step, no pickling.
"""

from __future__ import annotations

import time

import torch

from gearshift.worker.comm import CommGroup
from gearshift.worker.engine.plan import HEADER_SIZE, StepPlan
from gearshift.worker.parallel.collective_timing import CollectiveRequest

STEP, KEEPALIVE, SHUTDOWN, COLLECTIVES = 1, 2, 3, 4
Payload = StepPlan | CollectiveRequest | None


class ControlChannel:
    """Broadcasts from the group's first rank over the control group."""

    def __init__(self, group: CommGroup, keepalive_interval: float = 5.0) -> None:
        self.group = group
        self.keepalive_interval = keepalive_interval
        self._last_sent = time.monotonic()

    def _header(self) -> torch.Tensor:
        return torch.zeros(1 + HEADER_SIZE, dtype=torch.int64)

    def send(self, kind: int, plan: Payload = None) -> None:
        header = self._header()
        header[0] = kind
        body = None
        if isinstance(plan, CollectiveRequest):
            body = plan.pack()
            header[1] = body.numel()
        elif plan is not None:
            plan_header, body = plan.pack()
            header[1:] = plan_header
        self.group.broadcast_from_first(header)
        if body is not None:
            self.group.broadcast_from_first(body)
        self._last_sent = time.monotonic()

    def keepalive(self) -> None:
        """Keep idle followers inside their receive timeout."""
        if time.monotonic() - self._last_sent >= self.keepalive_interval:
            self.send(KEEPALIVE)

    def recv(self) -> tuple[int, Payload]:
        header = self.group.broadcast_from_first(self._header())
        kind = int(header[0])
        if kind == COLLECTIVES:
            body = torch.empty(int(header[1]), dtype=torch.int64)
            self.group.broadcast_from_first(body)
            return kind, CollectiveRequest.unpack(body)
        if kind != STEP:
            return kind, None
        plan_header = header[1:]
        body = torch.empty(StepPlan.body_size(plan_header), dtype=torch.int64)
        self.group.broadcast_from_first(body)
        return kind, StepPlan.unpack(plan_header, body)
