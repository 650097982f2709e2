"""Rebalancing a request's history KV evenly onto a chunk's group, overlapped with the chunk's
compute (Tetris §4.1, Fig. 6).

Before a chunk runs on a larger group, the members that just joined need their share of the
earlier chunks' KV. The messages go out per layer, all posted before the chunk starts, and a
member waits for a layer's pieces only when that layer's attention needs them
(``Rebalanced.layer``): layer i's transfer runs while layers before it compute. gloo runs posted
point-to-point messages on its own threads, so on CPU this overlap is real; NCCL does the same on
its streams. Each layer's messages carry their own tag, so they never pair with the ring
attention's messages between the same two members.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from gearshift.worker.policies.tetris.ring import Ring
from gearshift.worker.policies.tetris.zigzag import even_split

# Tags of the rebalance's messages (the ring attention uses the default tag 0).
_POSITIONS_TAG = 1 << 20
_LAYER_TAG = _POSITIONS_TAG + 1


@dataclass
class Holding:
    """The request's KV this member holds: ``kv`` [n, layers, 2, Hkv, D] and the prompt position
    of each row ``positions`` [n]."""

    kv: torch.Tensor
    positions: torch.Tensor

    @staticmethod
    def empty(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> Holding:
        kv = torch.empty((0, layers, 2, kv_heads, head_dim), dtype=dtype)
        return Holding(kv, torch.empty(0, dtype=torch.int64))

    def __len__(self) -> int:
        return int(self.kv.shape[0])


@dataclass
class _Piece:
    """Rows [offset, offset + n) of the virtual history sequence that this member gets: either
    its own rows (``layers`` views), or one message per layer (``layers`` buffers being
    received, each with its work)."""

    offset: int
    layers: list[torch.Tensor]  # [n, 2, Hkv, D] per layer
    positions: torch.Tensor
    works: list[dist.Work | None]  # per layer (empty for local rows)


class Rebalanced:
    """This member's share of the history, arriving layer by layer."""

    def __init__(
        self, template: torch.Tensor, pieces: list[_Piece], other_works: list[dist.Work | None]
    ) -> None:
        self._template = template  # [0, layers, 2, Hkv, D]: dtype and shape of a row
        self._pieces = sorted(pieces, key=lambda p: p.offset)
        self._other = other_works  # sends and position receives
        self._layers: dict[int, torch.Tensor] = {}

    def layer(self, i: int) -> torch.Tensor:
        """Layer ``i``'s history rows [n, 2, Hkv, D], once its messages have landed."""
        got = self._layers.get(i)
        if got is None:
            for piece in self._pieces:
                work = piece.works[i] if piece.works else None
                if work is not None:
                    work.wait()
            parts = [p.layers[i] for p in self._pieces]
            got = torch.cat(parts) if parts else self._template[:, i]
            self._layers[i] = got
        return got

    def finish(self) -> Holding:
        """Every layer and the rows' positions (waits for whatever is still in flight, this
        member's sends included)."""
        for work in self._other:
            if work is not None:
                work.wait()
        layers = int(self._template.shape[1])
        kv = torch.stack([self.layer(i) for i in range(layers)], dim=1)
        parts = [p.positions for p in self._pieces]
        positions = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        return Holding(kv, positions)


def rebalance(holding: Holding, counts: dict[int, int], ring: Ring) -> Rebalanced:
    """Spread the history held as ``counts`` (pool rank → rows; every member of ``ring`` knows
    them) evenly over ``ring``'s members, in ring order. Every member of the ring calls it; the
    messages are posted here and complete in the background.

    The rows, taken member by member in ring order, form one virtual sequence; member i of the
    ring ends up with the i-th of ``even_split``'s consecutive slices of it. Each overlap between
    what a member has and what another member gets is one point-to-point message per layer plus
    one for the positions."""
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
    me, group = ring.comm.rank, ring.comm.group
    layers = int(holding.kv.shape[1])
    pieces: list[_Piece] = []
    other: list[dist.Work | None] = []
    for m in order:
        have = (have_lo[m], have_lo[m] + counts.get(m, 0))
        for peer, share in zip(order, shares, strict=True):
            want = (want_lo[peer], want_lo[peer] + share)
            lo, hi = max(have[0], want[0]), min(have[1], want[1])
            if lo >= hi or (m != me and peer != me):
                continue
            if m == me and peer == me:
                rows = slice(lo - have[0], hi - have[0])
                own = [holding.kv[rows, i] for i in range(layers)]
                pieces.append(_Piece(lo, own, holding.positions[rows], []))
            elif m == me:  # send my rows [lo, hi) to `peer`, layer by layer
                rows = slice(lo - have[0], hi - have[0])
                dst = ring.comm.ranks[peer]
                other.append(
                    dist.isend(holding.positions[rows].contiguous(), dst, group, _POSITIONS_TAG)
                )
                for i in range(layers):
                    buf = holding.kv[rows, i].contiguous()
                    other.append(dist.isend(buf, dst, group, _LAYER_TAG + i))
            else:  # receive `m`'s rows [lo, hi)
                src = ring.comm.ranks[m]
                pos = holding.positions.new_empty(hi - lo)
                other.append(dist.irecv(pos, src, group, _POSITIONS_TAG))
                bufs = [
                    holding.kv.new_empty((hi - lo, *holding.kv.shape[2:])) for _ in range(layers)
                ]
                works = [dist.irecv(b, src, group, _LAYER_TAG + i) for i, b in enumerate(bufs)]
                pieces.append(_Piece(lo, bufs, pos, list(works)))
    mine = shares[ring.index]
    assert sum(len(p.positions) for p in pieces) == mine
    return Rebalanced(holding.kv[:0], pieces, other)
