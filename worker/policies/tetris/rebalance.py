"""Rebalancing a request's history KV evenly onto a chunk's group, layer by layer, overlapped
with the chunk's compute (Tetris §4.1, Fig. 6).

Before a chunk runs on a larger group, the members that just joined need their share of the
earlier chunks' KV. §4.1 (Fig. 6-b): "once the ring attention in current layer completes, its
inter-instance communicator can be reused to perform cache balancing for the next layer". So
layer 0's rows are posted when the chunk starts (they travel while the embedding and layer 0's
projections compute), and layer i+1's right after layer i's ring attention (``post``): they
travel while layer i's MLP and layer i+1's projections compute, and layer i+1's attention waits
only for its own (``layer``). The rows' prompt positions go once, after the last layer
(``finish``).

Every message travels on the ring's channel (the pool group's one ``worker/p2p`` channel), so
the k-th message between two members pairs with the k-th receive, NCCL's rule: every member
posts the same sequence (a layer's rebalance, then that layer's ring steps, then the next
layer's rebalance), and a layer's messages go as one batched exchange, labelled with the layer
and the rows, which the NCCL-rules mode checks on receipt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gearshift.worker.p2p import Pending, Recv, Send
from gearshift.worker.policies.tetris.ring import Ring
from gearshift.worker.policies.tetris.zigzag import even_split


@dataclass
class Holding:
    """The request's KV this member holds: ``kv`` [n, layers, 2, Hkv, D] and the prompt position
    of each row ``positions`` [n]."""

    kv: torch.Tensor
    positions: torch.Tensor

    @staticmethod
    def empty(
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | None = None,
    ) -> Holding:
        kv = torch.empty((0, layers, 2, kv_heads, head_dim), dtype=dtype, device=device)
        return Holding(kv, torch.empty(0, dtype=torch.int64, device=device))

    def __len__(self) -> int:
        return int(self.kv.shape[0])


@dataclass(frozen=True)
class _Move:
    """Rows [lo, hi) of the virtual history sequence between this member and ``peer`` (a group
    rank); ``rows``: where they sit in this member's holding (a send, or its own rows)."""

    peer: int
    lo: int
    hi: int
    rows: slice | None = None

    def label(self, what: str) -> str:
        return f"rebalance {what} rows [{self.lo},{self.hi})"


@dataclass
class _Layer:
    posted: Pending | None
    received: list[torch.Tensor]  # per receive move, [n, 2, Hkv, D]


@dataclass
class Rebalanced:
    """This member's share of the history, arriving layer by layer (see the module docstring)."""

    holding: Holding
    ring: Ring
    sends: list[_Move]
    receives: list[_Move]
    own: list[_Move]
    _layers: dict[int, _Layer] = field(default_factory=dict)
    _ready: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return int(self.holding.kv.shape[1])

    def post(self, i: int) -> None:
        """Post layer ``i``'s messages (once; beyond the last layer, nothing)."""
        if i >= self.num_layers or i in self._layers:
            return
        kv = self.holding.kv
        shape = kv.shape[2:]
        received = [kv.new_empty((m.hi - m.lo, *shape)) for m in self.receives]
        ops: list[Send | Recv] = [
            Recv(m.peer, buf, m.label(f"L{i}"))
            for m, buf in zip(self.receives, received, strict=True)
        ]
        ops += [Send(m.peer, kv[m.rows, i], m.label(f"L{i}")) for m in self.sends]
        pending = self.ring.link.exchange(ops) if ops else None
        self._layers[i] = _Layer(pending, received)

    def layer(self, i: int) -> torch.Tensor:
        """Layer ``i``'s history rows [n, 2, Hkv, D] in sequence order, once they have landed."""
        got = self._ready.get(i)
        if got is None:
            self.post(i)
            posted = self._layers[i]
            if posted.posted is not None:
                posted.posted.wait()
            parts = [(m.lo, self.holding.kv[m.rows, i]) for m in self.own]
            parts += [(m.lo, buf) for m, buf in zip(self.receives, posted.received, strict=True)]
            parts.sort(key=lambda p: p[0])
            kv = self.holding.kv
            got = torch.cat([p[1] for p in parts]) if parts else kv[:0, i]
            self._ready[i] = got
        return got

    def finish(self) -> Holding:
        """Every layer and the rows' positions (the positions go now, after every layer;
        waits for whatever is still in flight, this member's sends included)."""
        layers = [self.layer(i) for i in range(self.num_layers)]
        positions = self.holding.positions
        received = [positions.new_empty(m.hi - m.lo) for m in self.receives]
        ops: list[Send | Recv] = [
            Recv(m.peer, buf, m.label("positions"))
            for m, buf in zip(self.receives, received, strict=True)
        ]
        ops += [Send(m.peer, positions[m.rows], m.label("positions")) for m in self.sends]
        if ops:
            self.ring.link.exchange(ops).wait()
        for posted in self._layers.values():  # this member's sends of every layer
            if posted.posted is not None:
                posted.posted.wait()
        parts = [(m.lo, positions[m.rows]) for m in self.own]
        parts += [(m.lo, buf) for m, buf in zip(self.receives, received, strict=True)]
        parts.sort(key=lambda p: p[0])
        rows = torch.cat([p[1] for p in parts]) if parts else positions[:0]
        kv = torch.stack(layers, dim=1) if layers else self.holding.kv[:0]
        return Holding(kv, rows)


def rebalance(holding: Holding, counts: dict[int, int], ring: Ring) -> Rebalanced:
    """Spread the history held as ``counts`` (pool rank → rows; every member of ``ring`` knows
    them) evenly over ``ring``'s members, in ring order. Every member of the ring calls it;
    layer 0's messages are posted here, the others by ``Rebalanced.post`` (or when asked for).

    The rows, taken member by member in ring order, form one virtual sequence; member i of the
    ring ends up with the i-th of ``even_split``'s consecutive slices of it. Each overlap between
    what a member has and what another member gets is one message per layer plus one for the
    positions."""
    order = ring.members
    if set(counts) - set(order):
        raise ValueError(f"members {sorted(set(counts) - set(order))} hold history off the ring")
    have_lo, lo = {}, 0
    for m in order:
        have_lo[m], lo = lo, lo + counts.get(m, 0)
    shares = even_split(lo, len(order))
    want_lo, lo = {}, 0
    for m, share in zip(order, shares, strict=True):
        want_lo[m], lo = lo, lo + share
    me = ring.comm.rank
    sends: list[_Move] = []
    receives: list[_Move] = []
    own: list[_Move] = []
    for m in order:
        have = (have_lo[m], have_lo[m] + counts.get(m, 0))
        for peer, share in zip(order, shares, strict=True):
            want = (want_lo[peer], want_lo[peer] + share)
            lo, hi = max(have[0], want[0]), min(have[1], want[1])
            if lo >= hi or (m != me and peer != me):
                continue
            rows = slice(lo - have[0], hi - have[0])
            if m == me and peer == me:
                own.append(_Move(me, lo, hi, rows))
            elif m == me:  # my rows [lo, hi) go to `peer`
                sends.append(_Move(peer, lo, hi, rows))
            else:  # `m`'s rows [lo, hi) come here
                receives.append(_Move(m, lo, hi))
    mine = shares[ring.index]
    assert sum(m.hi - m.lo for m in own + receives) == mine
    moved = Rebalanced(holding, ring, sends, receives, own)
    moved.post(0)
    return moved
