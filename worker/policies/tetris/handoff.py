"""The KV hand-off from the prefill pool to a decode instance (Tetris §4.2, Fig. 7).

After the last chunk every member of its group holds rows of the request's KV (``Holding``:
rows in any order, each with its prompt position). Each member sends every rank of the chosen
decode instance that rank's KV heads of its rows (the decode instance's TP head split, the same
rule as its QKV projection: heads split over TP, or replicated when TP exceeds them), so the KV
is re-laid into the decode layout on the way. Row counts are known on both sides from the plan,
so no sizes travel. The decode rank writes the rows into its paged KV cache at the request's
slots.

A serving group hands the KV over in *pieces*: a run of one member's rows no larger than a
transfer buffer, each sent only after the receiver's manager granted it a slot
(``transfer.py``, the handshake of §4.2). Each slot is a point-to-point channel of its own (a
process group created at start, ``worker/p2p``), and a piece travels on its slot's channel as
one message per layer, layers 0 .. L−1, then one for the positions; its receiver posts its
receives in that order. Under NCCL's rules (no tags; the k-th send between two ranks meets the
k-th receive) that is what keeps pieces apart: two pieces in flight at once hold two slots,
hence two channels, even when one member streams both layer by layer (``stream.py``); one slot
carries one member's pieces in the order the member sends them, which is the order its grants
reach the decode instance. Every message is labelled with the piece's grant number
(``piece_label``), so the NCCL-rules mode checks each on receipt. ``send_kv`` / ``receive_kv``
move a whole request at once (no handshake) for tools and tests.

Buffers live on the ranks' devices; a channel over gloo stages device tensors through host
memory, over NCCL they travel as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gearshift.worker.attention.torch_ref import write_kv
from gearshift.worker.kv.cache import LayerKV
from gearshift.worker.p2p import P2P, Pending
from gearshift.worker.policies.tetris.rebalance import Holding


def piece_label(xfer: int, what: str) -> str:
    """The label of a piece's message: its grant number and the layer (``L3``) or
    ``positions``."""
    return f"kv piece {xfer} {what}"


def kv_heads_of(tp_rank: int, tp_size: int, kv_heads: int) -> slice:
    """The KV heads decode TP rank ``tp_rank`` keeps (QKVParallelLinear's rule)."""
    if tp_size >= kv_heads:
        if tp_size % kv_heads:
            raise ValueError(f"decode TP {tp_size} is not a multiple of {kv_heads} KV heads")
        head = tp_rank // (tp_size // kv_heads)
        return slice(head, head + 1)
    if kv_heads % tp_size:
        raise ValueError(f"{kv_heads} KV heads do not split over decode TP {tp_size}")
    per = kv_heads // tp_size
    return slice(tp_rank * per, (tp_rank + 1) * per)


def head_route(j: int, prefill_tp: int, t: int, decode_tp: int, kv_heads: int) -> slice | None:
    """The KV heads (global indices) prefill TP rank ``j`` sends to decode TP rank ``t``: what
    both hold, when ``j`` is the first prefill rank holding those heads (under replication,
    prefill TP above the KV heads, one copy travels); None when it sends that rank nothing."""
    mine = kv_heads_of(j, prefill_tp, kv_heads)
    theirs = kv_heads_of(t, decode_tp, kv_heads)
    start, stop = max(mine.start, theirs.start), min(mine.stop, theirs.stop)
    if start >= stop:
        return None
    if prefill_tp > kv_heads and j % (prefill_tp // kv_heads):
        return None
    return slice(start, stop)


@dataclass(frozen=True)
class Transfer:
    """Who sends what to whom: ``senders`` (ranks of ``comm``) with their row counts, the
    decode instance's ranks in TP order, and the first output token's sender."""

    senders: dict[int, int]
    receivers: tuple[int, ...]
    token_sender: int

    def __post_init__(self) -> None:
        if set(self.senders) & set(self.receivers):
            raise ValueError("a decode instance cannot share ranks with the prefill group")
        if self.token_sender not in self.senders:
            raise ValueError(f"the first token's sender {self.token_sender} sends no KV")


def send_kv(
    holding: Holding,
    first_token: int | None,
    transfer: Transfer,
    channel: P2P,
    xfer: int = 0,
) -> None:
    """A prefill member's side of a whole request: its rows as one piece (``xfer``), head-split
    for each decode rank, and the first token if it computed it. Returns once all is sent."""
    me = channel.comm.rank
    if len(holding) != transfer.senders[me]:
        raise ValueError(f"holding {len(holding)} rows, the plan says {transfer.senders}")
    sending = start_piece(holding, transfer.receivers, channel, xfer) if len(holding) else None
    if me == transfer.token_sender:
        if first_token is None:
            raise ValueError("this member computed no logits: it has no first token")
        token = torch.tensor([first_token], dtype=torch.int64, device=holding.kv.device)
        for dst in transfer.receivers:
            channel.send(token, dst, piece_label(xfer, "first token")).wait()
    if sending is not None:
        sending.wait()


def receive_kv(
    transfer: Transfer,
    channel: P2P,
    kv_cache: list[LayerKV],
    block_ids: list[int],
    kv_heads: int,
    xfer: int = 0,
) -> int:
    """A decode rank's side: every sender's rows of this rank's heads, written into ``kv_cache``
    (this rank's paged cache) at the request's slots (``block_ids`` in order); returns the first
    output token."""
    t = transfer.receivers.index(channel.comm.rank)
    heads = kv_heads_of(t, len(transfer.receivers), kv_heads)
    k_cache = kv_cache[0][0]
    if k_cache.shape[1] != heads.stop - heads.start:
        raise ValueError(f"the cache holds {k_cache.shape[1]} heads, this rank keeps {heads}")
    token = torch.empty(1, dtype=torch.int64, device=k_cache.device)
    posted = []
    for src, rows in transfer.senders.items():
        if rows:
            posted.append(post_piece(src, rows, channel, kv_cache, xfer))
        if src == transfer.token_sender:
            channel.recv(token, src, piece_label(xfer, "first token")).wait()
    for piece in posted:
        complete_piece(piece, kv_cache, block_ids)
    return int(token[0])


@dataclass
class Sending:
    """A piece's sends in flight (each keeps what it reads until it completes)."""

    pending: list[Pending] = field(default_factory=list)

    def done(self) -> bool:
        return all(p.done() for p in self.pending)

    def wait(self) -> None:
        for p in self.pending:
            p.wait()


def routes(
    receivers: tuple[int, ...], tp: tuple[int, int], kv_heads: int
) -> list[tuple[int, slice]]:
    """(decode rank, the local head slice it gets) for prefill TP rank ``tp`` = (j, TP)."""
    j, prefill_tp = tp
    base = kv_heads_of(j, prefill_tp, kv_heads).start
    out = []
    for t, dst in enumerate(receivers):
        heads = head_route(j, prefill_tp, t, len(receivers), kv_heads)
        if heads is not None:
            out.append((dst, slice(heads.start - base, heads.stop - base)))
    return out


def start_piece(
    rows: Holding,
    receivers: tuple[int, ...],
    channel: P2P,
    xfer: int,
    tp: tuple[int, int] = (0, 1),
    kv_heads: int | None = None,
) -> Sending:
    """A prefill rank's side of one granted piece (grant ``xfer``, on its slot's ``channel``),
    started: ``rows`` (a run of its holding, its TP rank's KV heads; ``tp`` = (its TP rank, the
    prefill TP), ``kv_heads`` the model's), each decode rank (ranks of the channel, in TP order)
    getting the heads ``head_route`` gives it, layer by layer, then the positions. The sends
    proceed in the background (the member computes its next prefill meanwhile); keep the
    result until ``done``."""
    total = rows.kv.shape[3] if kv_heads is None else kv_heads
    sending = Sending()
    layers = rows.kv.shape[1]
    for dst, local in routes(receivers, tp, total):
        for i in range(layers):
            label = piece_label(xfer, f"L{i}")
            sending.pending.append(channel.send(rows.kv[:, i, :, local], dst, label))
        label = piece_label(xfer, "positions")
        sending.pending.append(channel.send(rows.positions, dst, label))
    return sending


@dataclass
class Posted:
    """A piece's receives posted on a decode rank: per sender, a buffer per layer
    [rows, 2, heads, D], and the positions; ``error``: a receive that could not be posted (its
    sender is gone), raised when the piece completes."""

    pending: list[Pending]
    layers: list[list[torch.Tensor]]
    positions: torch.Tensor
    error: RuntimeError | None = None


def post_piece(
    src: int | list[tuple[int, int]],
    rows: int,
    channel: P2P,
    kv_cache: list[LayerKV],
    xfer: int,
) -> Posted:
    """A decode rank posts the receives of piece ``xfer`` on its slot's ``channel``: ``rows``
    rows of its heads from ``src`` (a rank of the channel; or, from a prefill instance of
    TP > 1, its ranks as (rank, heads it sends here), in head order). They complete in the
    background (a streamed piece's while the pool still computes)."""
    k_cache = kv_cache[0][0]
    head_dim, device = k_cache.shape[3], k_cache.device
    posted = Posted([], [], torch.empty(rows, dtype=torch.int64, device=device))

    def receive(buf: torch.Tensor, peer: int, label: str) -> None:
        try:
            posted.pending.append(channel.recv(buf, peer, label))
        except RuntimeError as exc:  # the sender is gone already: the piece fails when done
            posted.error = posted.error or exc

    for k, (rank, heads) in enumerate(_sources(src, k_cache.shape[1])):
        shape = (rows, 2, heads, head_dim)
        bufs = [torch.empty(shape, dtype=k_cache.dtype, device=device) for _ in kv_cache]
        for i, buf in enumerate(bufs):
            receive(buf, rank, piece_label(xfer, f"L{i}"))
        # Every sender sends the positions; the first sender's are kept.
        where = posted.positions if k == 0 else torch.empty_like(posted.positions)
        receive(where, rank, piece_label(xfer, "positions"))
        posted.layers.append(bufs)
    return posted


def complete_piece(posted: Posted, kv_cache: list[LayerKV], block_ids: list[int]) -> None:
    """Wait for a posted piece (every receive, even after one fails: none stays posted) and
    write it into the paged ``kv_cache`` at the request's slots (``block_ids``; empty: drop)."""
    error = posted.error
    for pending in posted.pending:
        try:
            pending.wait()
        except RuntimeError as exc:
            error = error or exc
    if error is not None:
        raise error
    if not block_ids:
        return
    slots = _slots(posted.positions, block_ids, kv_cache[0][0].shape[2])
    for layer, cache in enumerate(kv_cache):
        parts = [bufs[layer] for bufs in posted.layers]
        kv = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
        write_kv(cache, kv[:, 0], kv[:, 1], slots)


def receive_piece(
    src: int | list[tuple[int, int]],
    rows: int,
    channel: P2P,
    kv_cache: list[LayerKV],
    block_ids: list[int],
    xfer: int,
) -> None:
    """A decode rank's side of one whole piece: ``post_piece`` then ``complete_piece``
    (``block_ids`` empty: received and dropped, for a request the instance no longer holds)."""
    complete_piece(post_piece(src, rows, channel, kv_cache, xfer), kv_cache, block_ids)


def _slots(pos: torch.Tensor, block_ids: list[int], block_size: int) -> torch.Tensor:
    """The paged-cache slots of prompt positions ``pos`` in a request's blocks."""
    if len(pos) and int(pos.max()) >= len(block_ids) * block_size:
        raise ValueError(f"position {int(pos.max())} lies beyond the request's blocks")
    table = torch.tensor(block_ids, dtype=torch.int64, device=pos.device)
    return table[pos // block_size] * block_size + pos % block_size


def _sources(src: int | list[tuple[int, int]], local_heads: int) -> list[tuple[int, int]]:
    sources = [(src, local_heads)] if isinstance(src, int) else src
    if sum(n for _, n in sources) != local_heads:
        raise ValueError(f"the senders' heads {sources} do not make this rank's {local_heads}")
    return sources
