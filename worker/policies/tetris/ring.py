"""Zig-zag pass-KV ring attention over any subset of one process group's ranks (Tetris §2.3, §4.1).

Every member holds its zig-zag rows of a chunk (q, k, v) and, for a chunk after the first, its
share of the earlier chunks' KV (the history, rebalanced evenly onto the group before the chunk).
In N steps each member's KV block travels once round the ring by point-to-point isend/irecv on
the pool's one process group, so any subset of the pool can form a ring without creating a group.
The next block's transfer is posted before the current block is attended, so they overlap.

Per step a member attends its query shards to the block it holds: a history piece is wholly in
the past of every query; chunk shard b is wholly visible to query shard a when b < a, causal when
b == a (only the member's own block) and invisible when b > a. With zig-zag shards every step
after the first costs half a block's work on every member. Partial results merge exactly by
log-sum-exp (``merge_partials``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from gearshift.worker.attention.core import attention_lse, merge_partials
from gearshift.worker.comm import CommGroup
from gearshift.worker.policies.tetris.zigzag import ZigZag


@dataclass(frozen=True)
class Ring:
    """Members of one ring: group ranks of ``comm`` in ring order; this rank must be one."""

    comm: CommGroup
    members: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(set(self.members)) != len(self.members) or not self.members:
            raise ValueError(f"ring members must be distinct and non-empty: {self.members}")
        if any(not 0 <= m < self.comm.size for m in self.members):
            raise ValueError(f"ring members {self.members} outside a group of {self.comm.size}")
        if self.comm.rank not in self.members:
            raise ValueError(f"group rank {self.comm.rank} is not in ring {self.members}")

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def index(self) -> int:
        """This rank's position in the ring."""
        return self.members.index(self.comm.rank)

    def global_rank(self, position: int) -> int:
        """The global rank of the member at ring position ``position`` (mod the ring size)."""
        return self.comm.ranks[self.members[position % self.size]]


@dataclass(frozen=True)
class History:
    """This member's share of earlier chunks' KV, and every member's share length (ring order)."""

    k: torch.Tensor  # [lengths[index], Hkv, D]
    v: torch.Tensor
    lengths: tuple[int, ...]


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ring: Ring,
    layout: ZigZag,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of a chunk (no history) from this member's zig-zag rows.

    q [n_i, Hq, D], k/v [n_i, Hkv, D] are ``layout.split(·, ring.index)`` of the chunk; returns
    (out [n_i, Hq, D], lse [n_i, Hq] fp32) for the same rows. Every member calls it together.
    """
    empty = k[:0]
    history = History(empty, empty, (0,) * ring.size)
    return ring_attention_with_history(q, k, v, history, ring, layout, scale)


def ring_attention_with_history(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    history: History,
    ring: Ring,
    layout: ZigZag,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ring_attention`` for a chunk that also attends to the history spread over the ring
    (CDSP §4.1): every history token precedes every chunk token."""
    me, size = ring.index, ring.size
    if layout.members != size or len(history.lengths) != size:
        raise ValueError(
            f"layout of {layout.members} / history of {len(history.lengths)} "
            f"members for a ring of {size}"
        )
    if q.shape[0] != layout.local_length(me) or history.k.shape[0] != history.lengths[me]:
        raise ValueError("local rows do not match the zig-zag layout or the history lengths")
    # One contiguous block per member: its chunk rows, then its history rows; k and v together.
    block = torch.cat((torch.stack((k, v), dim=1), torch.stack((history.k, history.v), dim=1)))
    acc_out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    acc_lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    for step in range(size):
        origin = (me - step) % size  # the member whose block we hold this step
        pending: list[dist.Work] = []
        incoming = block
        if step < size - 1:
            incoming, pending = _pass_on(block, ring, step, layout, history.lengths)
        hist_rows = history.lengths[origin]
        _attend_block(q, block, origin, me, layout, hist_rows, scale, (acc_out, acc_lse))
        for work in pending:
            work.wait()
        block = incoming
    return acc_out.to(q.dtype), acc_lse


def _pass_on(
    block: torch.Tensor,
    ring: Ring,
    step: int,
    layout: ZigZag,
    history_lengths: tuple[int, ...],
) -> tuple[torch.Tensor, list[dist.Work]]:
    """Post this step's send of ``block`` to the next member and the receive of the previous
    member's; sizes are known from the layout, so an empty block is neither sent nor awaited."""
    me, size = ring.index, ring.size
    sender = (me - step - 1) % size  # origin of the block the previous member forwards now
    rows = layout.local_length(sender) + history_lengths[sender]
    incoming = block.new_empty((rows, *block.shape[1:]))
    works: list[dist.Work | None] = []
    if rows:
        works.append(dist.irecv(incoming, src=ring.global_rank(me - 1), group=ring.comm.group))
    if block.shape[0]:
        works.append(dist.isend(block, dst=ring.global_rank(me + 1), group=ring.comm.group))
    return incoming, [w for w in works if w is not None]


def _attend_block(
    q: torch.Tensor,
    block: torch.Tensor,
    origin: int,
    me: int,
    layout: ZigZag,
    history_rows: int,
    scale: float,
    acc: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """Merge this member's queries over ``origin``'s block into ``acc`` (out, lse) in place."""
    acc_out, acc_lse = acc
    chunk_rows = layout.local_length(origin)
    kv_shards = layout.shards(origin)
    # Rows of each of the block's two chunk shards inside the block.
    first = layout.span(kv_shards[0])
    offsets = {kv_shards[0]: 0, kv_shards[1]: first[1] - first[0]}
    history = block[chunk_rows : chunk_rows + history_rows]
    row = 0
    for qs in layout.shards(me):
        lo, hi = layout.span(qs)
        rows = slice(row, row + hi - lo)
        row += hi - lo
        if hi == lo:
            continue
        visible = [history] + [
            block[offsets[b] : offsets[b] + layout.span(b)[1] - layout.span(b)[0]]
            for b in kv_shards
            if b < qs
        ]
        seen = torch.cat(visible)
        parts = [attention_lse(q[rows], *_kv(seen), scale, causal=False)] if len(seen) else []
        if qs in kv_shards:  # our own block: the shard's causal diagonal
            own = block[offsets[qs] : offsets[qs] + hi - lo]
            parts.append(attention_lse(q[rows], *_kv(own), scale, causal=True))
        outs = [acc_out[rows]] + [p[0] for p in parts]
        lses = [acc_lse[rows]] + [p[1] for p in parts]
        acc_out[rows], acc_lse[rows] = merge_partials(outs, lses)


def _kv(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[L, 2, Hkv, D] → (k, v), each [L, Hkv, D]."""
    return packed[:, 0], packed[:, 1]
