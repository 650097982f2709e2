"""Zig-zag pass-KV ring attention over any subset of one pool group's ranks (Tetris §2.3, §4.1).

Every member holds its zig-zag rows of a chunk (q, k, v) and, for a chunk after the first, its
share of the earlier chunks' KV (the history, rebalanced evenly onto the group). In N steps each
member's block (its history then its chunk rows, as one paged KV context:
``block_attention.paged_block``) travels once round the ring on the pool group's point-to-point
channel (``worker/p2p``), so any subset of the pool forms a ring without creating a group. Each
step is one batched exchange: the block goes to the next member and the previous member's comes
in (a batch even when they are one member: NCCL's rule for opposite directions), labelled with
the layer, the step and whose block it is, so the NCCL-rules mode checks every message. The
next block's exchange is posted before the current block is attended, so they overlap.

Per step a member attends its query shards to the block it holds through the rank's attention
core (``block_attention.attend_block``: Triton's kernels on a GPU): a history piece is wholly in
the past of every query; chunk shard b is wholly visible to query shard a when b < a, causal
when b == a (only the member's own block) and invisible when b > a. With zig-zag shards every
step after the first costs half a block's work on every member. Partial results merge exactly
by log-sum-exp (``merge_partials``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gearshift.worker.attention.core import AttentionCore, merge_partials
from gearshift.worker.attention.torch_ref import TorchAttention
from gearshift.worker.comm import CommGroup
from gearshift.worker.p2p import P2P, Pending, Recv, Send
from gearshift.worker.policies.tetris.block_attention import attend_block, block_shape, paged_block
from gearshift.worker.policies.tetris.zigzag import ZigZag


@dataclass(frozen=True)
class Ring:
    """Members of one ring: group ranks of ``comm`` in ring order; this rank must be one.
    ``channel``: the group's point-to-point channel (a ring of more than one member needs it)."""

    comm: CommGroup
    members: tuple[int, ...]
    channel: P2P | None = None

    def __post_init__(self) -> None:
        if len(set(self.members)) != len(self.members) or not self.members:
            raise ValueError(f"ring members must be distinct and non-empty: {self.members}")
        if any(not 0 <= m < self.comm.size for m in self.members):
            raise ValueError(f"ring members {self.members} outside a group of {self.comm.size}")
        if self.comm.rank not in self.members:
            raise ValueError(f"group rank {self.comm.rank} is not in ring {self.members}")
        if len(self.members) > 1 and (
            self.channel is None or self.channel.comm.ranks != self.comm.ranks
        ):
            raise ValueError(f"a ring of {len(self.members)} needs its group's p2p channel")

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def index(self) -> int:
        """This rank's position in the ring."""
        return self.members.index(self.comm.rank)

    def peer(self, position: int) -> int:
        """The group rank of the member at ring position ``position`` (mod the ring size)."""
        return self.members[position % self.size]

    @property
    def link(self) -> P2P:
        assert self.channel is not None, "a ring of one member sends nothing"
        return self.channel


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
    core: AttentionCore | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of a chunk (no history) from this member's zig-zag rows.

    q [n_i, Hq, D], k/v [n_i, Hkv, D] are ``layout.split(·, ring.index)`` of the chunk; returns
    (out [n_i, Hq, D], lse [n_i, Hq] fp32) for the same rows. Every member calls it together.
    """
    empty = k[:0]
    history = History(empty, empty, (0,) * ring.size)
    return ring_attention_with_history(q, k, v, history, ring, layout, scale, core)


def ring_attention_with_history(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    history: History,
    ring: Ring,
    layout: ZigZag,
    scale: float,
    core: AttentionCore | None = None,
    label: str = "ring",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ring_attention`` for a chunk that also attends to the history spread over the ring
    (CDSP §4.1): every history token precedes every chunk token. ``core``: the rank's attention
    core (its own scale applies; None: the torch reference at ``scale``); ``label`` prefixes
    the messages' labels (the layer)."""
    me, size = ring.index, ring.size
    if layout.members != size or len(history.lengths) != size:
        raise ValueError(
            f"layout of {layout.members} / history of {len(history.lengths)} "
            f"members for a ring of {size}"
        )
    if q.shape[0] != layout.local_length(me) or history.k.shape[0] != history.lengths[me]:
        raise ValueError("local rows do not match the zig-zag layout or the history lengths")
    core = TorchAttention(scale) if core is None else core
    block = paged_block((history.k, history.v), k, v)
    acc_out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    acc_lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    for step in range(size):
        origin = (me - step) % size  # the member whose block we hold this step
        pending: Pending | None = None
        incoming = block
        if step < size - 1:
            incoming, pending = _pass_on(block, ring, step, layout, history.lengths, label)
        part = attend_block(core, q, block, origin, me, layout, history.lengths[origin])
        if part is not None:
            acc_out, acc_lse = merge_partials([acc_out, part[0]], [acc_lse, part[1]])
        if pending is not None:
            pending.wait()
        block = incoming
    return acc_out.to(q.dtype), acc_lse


def _pass_on(
    block: torch.Tensor,
    ring: Ring,
    step: int,
    layout: ZigZag,
    history_lengths: tuple[int, ...],
    label: str,
) -> tuple[torch.Tensor, Pending | None]:
    """Post this step's exchange: ``block`` to the next member, the previous member's block in.
    Sizes are known from the layout, so an empty block is left out on both sides."""
    me, size = ring.index, ring.size
    origin = (me - step) % size
    sender = (me - step - 1) % size  # origin of the block the previous member forwards now
    rows = layout.local_length(sender) + history_lengths[sender]
    incoming = block.new_empty(block_shape(rows, block.shape[2], block.shape[4]))
    ops: list[Send | Recv] = []
    if rows:
        ops.append(Recv(ring.peer(me - 1), incoming, f"{label} step {step} block {sender}"))
    if block.shape[1]:
        ops.append(Send(ring.peer(me + 1), block, f"{label} step {step} block {origin}"))
    return incoming, ring.link.exchange(ops) if ops else None
