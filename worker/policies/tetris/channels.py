"""The point-to-point channels of a Tetris group (``worker/p2p``, NCCL's contract), created once
at start on every rank, in one order (creating a process group is collective over the world):

- a *pool* channel per TP index j: ranks j, Tp + j, 2·Tp + j … (the same head shard of every
  prefill instance). A chunk's ring and its history rebalancing run on it (any subset of the
  pool forms a ring without creating a group on the hot path; ``ring.py``, ``rebalance.py``);
- a *slot* channel per transfer slot of a decode instance (``transferBackends``, §4.2's backend
  allocation handshake), over every rank: a granted piece travels on its slot's channel
  (``handoff.py``), so two pieces in flight never share a per-pair FIFO. Slot s of every decode
  instance shares channel s: their pairs (sender, decode rank) are disjoint.

One process group per channel: NCCL keeps one FIFO per pair of ranks and communicator.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from gearshift.worker.comm import CommGroup
from gearshift.worker.p2p import P2P


@dataclass(frozen=True)
class TetrisChannels:
    """This rank's channels: its pool's (prefill ranks of a pool of two or more instances),
    and every transfer slot's."""

    pool: P2P | None
    slots: tuple[P2P, ...]

    def close(self) -> None:
        for channel in (self.pool, *self.slots):
            if channel is not None:
                channel.close()


def open_channels(
    rank: int,
    world_size: int,
    pools: list[tuple[int, ...]],
    slots: int,
    device: torch.device,
    timeout: timedelta,
) -> TetrisChannels:
    """Every rank calls this with the same ``pools`` (each TP index's prefill ranks, instance
    order) and ``slots``; it joins the groups it belongs to."""
    pool = None
    for j, ranks in enumerate(pools):
        if len(ranks) < 2:
            continue
        pg = dist.new_group(list(ranks), timeout=timeout)
        if rank in ranks:
            comm = CommGroup(len(ranks), ranks.index(rank), ranks, pg)
            pool = P2P(comm, f"tetris pool tp{j}", device, timeout)
    everyone = tuple(range(world_size))
    channels = []
    for s in range(slots):
        pg = dist.new_group(list(everyone), timeout=timeout)
        comm = CommGroup(world_size, rank, everyone, pg)
        channels.append(P2P(comm, f"tetris transfer slot {s}", device, timeout))
    return TetrisChannels(pool, tuple(channels))
