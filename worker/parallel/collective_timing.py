"""Time a running group's collectives inside its own worker processes (issue 30, item 1:
``gearshift profile --layouts`` records them beside the step costs).

Every rank runs the same request in lockstep (the leader sends it over the control channel,
``engine/control.py``): for each collective and message size one untimed call, then ``repeats``
timed calls, each started after a barrier so that no rank's clock includes waiting for a late
peer to arrive. A call's time is the slowest rank's (a collective is done when every rank is),
and a point is the median over the repeats. Tensors live on the rank's device and cross the
group the way the layers' do (``CommGroup``; ``P2P`` for send/recv), so the figures are those of
the group's backend: gloo on CPU, NCCL on GPUs.

What ``bytes`` means per collective, as the simulator's α-β model takes it (sim/roofline.py):
``all_reduce``: the reduced buffer; ``all_to_all``: what one rank holds before the exchange;
``all_gather``: the gathered result (every rank's part together); ``send_recv``: one message,
sent by every rank but the last to the next one at once (pipeline stages' activations).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from gearshift.worker.comm import CommGroup
from gearshift.worker.p2p import P2P, Recv, Send

COLLECTIVES = ("all_reduce", "all_to_all", "all_gather", "send_recv")
ELEMENT = torch.float32  # 4 bytes; sizes are rounded down to whole elements per rank
P2P_LABEL = "collective timing"


@dataclass(frozen=True)
class CollectiveRequest:
    """Which collectives to time, at which message sizes (bytes), how many timed calls each."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    repeats: int
    timeout_s: int = 120  # of the send/recv channel's own process group

    def __post_init__(self) -> None:
        unknown = [n for n in self.names if n not in COLLECTIVES]
        if unknown:
            raise ValueError(f"collectives: {unknown[0]!r} not one of {', '.join(COLLECTIVES)}")
        if not self.sizes or any(s < 1 for s in self.sizes):
            raise ValueError(f"collective sizes: positive byte counts, got {self.sizes}")
        if self.repeats < 1:
            raise ValueError(f"collective repeats: at least 1, got {self.repeats}")
        if self.timeout_s < 1:
            raise ValueError(f"collective timeout: at least 1 s, got {self.timeout_s}")

    def pack(self) -> torch.Tensor:
        """The request as int64s: name count, name indices, size count, sizes, repeats,
        timeout."""
        ids = [COLLECTIVES.index(n) for n in self.names]
        sizes = list(self.sizes)
        return torch.tensor(
            [len(ids), *ids, len(sizes), *sizes, self.repeats, self.timeout_s], dtype=torch.int64
        )

    @staticmethod
    def unpack(body: torch.Tensor) -> CollectiveRequest:
        v = [int(x) for x in body.tolist()]
        n = v[0]
        names = tuple(COLLECTIVES[i] for i in v[1 : 1 + n])
        m = v[1 + n]
        sizes = tuple(v[2 + n : 2 + n + m])
        return CollectiveRequest(names, sizes, v[2 + n + m], v[3 + n + m])


Points = list[list[float]]  # [[bytes, seconds], ...]


def time_collectives(
    request: CollectiveRequest, world: CommGroup, device: torch.device
) -> dict[str, Points]:
    """Run ``request`` on this rank of ``world`` (every rank calls it); each collective's
    [[bytes, median seconds], ...] in size order (the same on every rank)."""
    if world.size == 1:
        return {}
    out: dict[str, Points] = {}
    for name in request.names:
        channel = None
        if name == "send_recv":
            channel = _channel(world, device, timedelta(seconds=request.timeout_s))
        try:
            out[name] = [
                _point(_Call(name, size, world, device, channel), request.repeats)
                for size in sorted(set(request.sizes))
            ]
        finally:
            if channel is not None:
                channel.close()
                dist.destroy_process_group(channel.comm.group)
    return out


def _point(call: _Call, repeats: int) -> list[float]:
    call.run()  # untimed: first-call set-up (buffers, NCCL channels) is not a message's
    samples = [_timed(call, call.world, call.device) for _ in range(repeats)]
    return [float(call.nbytes), statistics.median(samples)]


def _channel(world: CommGroup, device: torch.device, timeout: timedelta) -> P2P:
    """send/recv's channel, on a process group of its own (``P2P``: one channel per group)."""
    everyone = list(range(world.size))
    pg = dist.new_group(everyone, timeout=timeout)  # collective: every rank, in order
    return P2P(CommGroup(world.size, world.rank, tuple(everyone), pg), P2P_LABEL, device, timeout)


def _timed(call: _Call, world: CommGroup, device: torch.device) -> float:
    _sync(device)
    dist.barrier(group=world.group)
    start = time.perf_counter()
    call.run()
    _sync(device)
    mine = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    on = device if dist.get_backend(world.group) == "nccl" else torch.device("cpu")
    slowest = mine.to(on)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=world.group)
    return float(slowest.item())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Call:
    """One collective at one size on this rank; ``nbytes`` as the module docstring counts them
    (``size`` rounded down to whole elements per rank)."""

    def __init__(
        self,
        name: str,
        size: int,
        world: CommGroup,
        device: torch.device,
        channel: P2P | None = None,
    ) -> None:
        self.name, self.world, self.device, self.channel = name, world, device, channel
        t = world.size
        per = max(1, size // ELEMENT.itemsize // t)  # elements per rank's part
        self.buf = torch.ones(
            per if name == "all_gather" else per * t, dtype=ELEMENT, device=device
        )
        self.nbytes = per * t * ELEMENT.itemsize
        self.ops: list[Send | Recv] = []
        if channel is not None:
            if world.rank > 0:
                self.ops.append(Recv(world.rank - 1, torch.empty_like(self.buf), P2P_LABEL))
            if world.rank < t - 1:
                self.ops.append(Send(world.rank + 1, self.buf, P2P_LABEL))

    def run(self) -> None:
        if self.name == "all_reduce":
            self.world.all_reduce(self.buf)
        elif self.name == "all_to_all":
            self.world.all_to_all(self.buf)
        elif self.name == "all_gather":
            self.world.all_gather(self.buf)
        else:
            assert self.channel is not None, "send_recv runs on its own channel"
            self.channel.exchange(self.ops).wait()
