"""The KV hand-off from the prefill pool to a decode instance (Tetris §4.2, Fig. 7).

After the last chunk every member of its group holds rows of the request's KV (``Holding``:
rows in any order, each with its prompt position). Each member sends every rank of the chosen
decode instance that rank's KV heads of its rows (the decode instance's TP head split, the same
rule as its QKV projection: heads split over TP, or replicated when TP exceeds them), so the KV
is re-laid into the decode layout on the way. Row counts are known on both sides from the plan,
so no sizes travel. The member that computed the last prompt token's logits also sends the first
output token. The decode rank writes the rows into its paged KV cache at the request's slots.

A serving group hands the KV over in *pieces* (``send_piece`` / ``receive_piece``): a run of one
member's rows no larger than a transfer buffer, each sent only after the receiver's manager
granted it a slot (``transfer.py``, the handshake of §4.2). ``send_kv`` / ``receive_kv`` move a
whole request at once (no handshake) for tools and tests.

With ``layerwise_transfer`` a piece is *streamed* (``LayerStream``, ``post_piece`` /
``complete_piece``): its handshake runs while the prefill computes (§4.2: "the handshake ...
integrated into layer-wise cache transmission", overlapped with the prefill), the decode ranks post
a receive per layer as soon as the slot is granted, and the member sends each layer's rows the
moment the plan's last chunk has computed that layer, while the later layers still run. Each
streamed piece has its own tags (``stream_tag``), so pieces in flight between the same two ranks
never pair with each other's messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gearshift.worker.attention.torch_ref import write_kv
from gearshift.worker.comm import CommGroup
from gearshift.worker.kv.cache import LayerKV
from gearshift.worker.policies.tetris.chunked_prefill import Holding


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


def send_kv(holding: Holding, first_token: int | None, transfer: Transfer, comm: CommGroup) -> None:
    """A prefill member's side: its rows, head-split for each decode rank (and the first token
    if it computed it). Returns once everything is sent."""
    if len(holding) != transfer.senders[comm.rank]:
        raise ValueError(f"holding {len(holding)} rows, the plan says {transfer.senders}")
    kv_heads = holding.kv.shape[3]
    works = []
    for t, dst in enumerate(transfer.receivers):
        heads = kv_heads_of(t, len(transfer.receivers), kv_heads)
        if len(holding):
            rows = holding.kv[:, :, :, heads].contiguous()
            works.append(dist.isend(rows, comm.ranks[dst], comm.group))
            works.append(dist.isend(holding.positions.contiguous(), comm.ranks[dst], comm.group))
        if comm.rank == transfer.token_sender:
            if first_token is None:
                raise ValueError("this member computed no logits: it has no first token")
            token = torch.tensor([first_token], dtype=torch.int64)
            works.append(dist.isend(token, comm.ranks[dst], comm.group))
    for work in works:
        if work is not None:
            work.wait()


def receive_kv(
    transfer: Transfer,
    comm: CommGroup,
    kv_cache: list[LayerKV],
    block_ids: list[int],
    kv_heads: int,
) -> int:
    """A decode rank's side: every sender's rows of this rank's heads, written into ``kv_cache``
    (this rank's paged cache) at the request's slots (``block_ids`` in order); returns the first
    output token."""
    t = transfer.receivers.index(comm.rank)
    heads = kv_heads_of(t, len(transfer.receivers), kv_heads)
    k_cache = kv_cache[0][0]
    layers, block_size, head_dim = len(kv_cache), k_cache.shape[2], k_cache.shape[3]
    local_heads = heads.stop - heads.start
    if k_cache.shape[1] != local_heads:
        raise ValueError(f"the cache holds {k_cache.shape[1]} heads, this rank keeps {heads}")
    pieces = []
    works = []
    token = torch.empty(1, dtype=torch.int64)
    for src, rows in transfer.senders.items():
        if rows:
            kv = torch.empty((rows, layers, 2, local_heads, head_dim), dtype=k_cache.dtype)
            pos = torch.empty(rows, dtype=torch.int64)
            works.append(dist.irecv(kv, comm.ranks[src], comm.group))
            works.append(dist.irecv(pos, comm.ranks[src], comm.group))
            pieces.append((kv, pos))
        if src == transfer.token_sender:
            works.append(dist.irecv(token, comm.ranks[src], comm.group))
    for work in works:
        if work is not None:
            work.wait()
    for kv, pos in pieces:
        slots = _slots(pos, block_ids, block_size)
        for layer, cache in enumerate(kv_cache):
            write_kv(cache, kv[:, layer, 0], kv[:, layer, 1], slots)
    return int(token[0])


@dataclass
class Sending:
    """A piece's sends in flight: their works, and the buffers they read until they complete."""

    works: list
    buffers: list[torch.Tensor]

    def done(self) -> bool:
        return all(w is None or w.is_completed() for w in self.works)

    def wait(self) -> None:
        for work in self.works:
            if work is not None:
                work.wait()


def _routes(
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
    comm: CommGroup,
    tp: tuple[int, int] = (0, 1),
    kv_heads: int | None = None,
) -> Sending:
    """A prefill rank's side of one granted piece, started: ``rows`` (a run of its holding, its
    TP rank's KV heads; ``tp`` = (its TP rank, the prefill TP), ``kv_heads`` the model's),
    each decode rank (ranks of ``comm``, in TP order) getting the heads ``head_route`` gives it.
    The sends proceed in the background (the member computes its next prefill meanwhile); keep
    the result until ``done``."""
    total = rows.kv.shape[3] if kv_heads is None else kv_heads
    sending = Sending([], [])
    for dst, local in _routes(receivers, tp, total):
        for buf in (rows.kv[:, :, :, local].contiguous(), rows.positions.contiguous()):
            sending.buffers.append(buf)
            sending.works.append(dist.isend(buf, comm.ranks[dst], comm.group))
    return sending


def send_piece(rows: Holding, receivers: tuple[int, ...], comm: CommGroup) -> None:
    """``start_piece`` of a TP-1 prefill rank, and wait until it is sent."""
    start_piece(rows, receivers, comm).wait()


def receive_piece(
    src: int | list[tuple[int, int]],
    rows: int,
    comm: CommGroup,
    kv_cache: list[LayerKV],
    block_ids: list[int],
) -> None:
    """A decode rank's side of one piece: ``rows`` rows of its heads from ``src`` (a rank of
    ``comm``; or, from a prefill instance of TP > 1, its ranks as (rank, heads it sends here),
    in head order), written into its paged ``kv_cache`` at the request's slots (``block_ids``;
    empty: received and dropped, for a request the instance no longer holds)."""
    k_cache = kv_cache[0][0]
    local_heads, block_size, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    sources = _sources(src, local_heads)
    parts, works = [], []
    pos = torch.empty(rows, dtype=torch.int64)
    for k, (rank, heads) in enumerate(sources):
        part = torch.empty((rows, len(kv_cache), 2, heads, head_dim), dtype=k_cache.dtype)
        where = pos if k == 0 else torch.empty_like(pos)  # every sender sends the positions
        parts += [part, where]
        works.append(dist.irecv(part, comm.ranks[rank], comm.group))
        works.append(dist.irecv(where, comm.ranks[rank], comm.group))
    for work in works:
        if work is not None:
            work.wait()
    kv = parts[0] if len(parts) == 2 else torch.cat(parts[0::2], dim=3)
    if not block_ids:
        return
    slots = _slots(pos, block_ids, block_size)
    for layer, cache in enumerate(kv_cache):
        write_kv(cache, kv[:, layer, 0], kv[:, layer, 1], slots)


def _slots(pos: torch.Tensor, block_ids: list[int], block_size: int) -> torch.Tensor:
    """The paged-cache slots of prompt positions ``pos`` in a request's blocks."""
    if len(pos) and int(pos.max()) >= len(block_ids) * block_size:
        raise ValueError(f"position {int(pos.max())} lies beyond the request's blocks")
    table = torch.tensor(block_ids, dtype=torch.int64)
    return table[pos // block_size] * block_size + pos % block_size


def _sources(src: int | list[tuple[int, int]], local_heads: int) -> list[tuple[int, int]]:
    sources = [(src, local_heads)] if isinstance(src, int) else src
    if sum(n for _, n in sources) != local_heads:
        raise ValueError(f"the senders' heads {sources} do not make this rank's {local_heads}")
    return sources


# ---- layer-wise streaming (layerwise_transfer) ------------------------------------------

STREAM_TAG = 1 << 24  # above every other tag of the group (ring 0, rebalance 1 << 20 ..)
TAG_STRIDE = 1024  # tags per streamed piece: one per layer, the last for the positions
STREAM_IDS = 1 << 16  # streamed pieces in flight in a group stay far below this


def stream_tag(xfer: int) -> int:
    """The first tag of the ``xfer``-th streamed piece of a group (its grant number)."""
    return STREAM_TAG + (xfer % STREAM_IDS) * TAG_STRIDE


def check_stream_layers(layers: int) -> None:
    if layers >= TAG_STRIDE:
        raise ValueError(f"layer-wise transfer tags {TAG_STRIDE - 1} layers at most, not {layers}")


@dataclass
class _Grant:
    tag: int
    sending: Sending
    layers: int = 0  # layers sent so far
    early: int = 0  # of them, layers sent while the prefill still computed
    done: bool = False  # every layer and the positions sent


class LayerStream:
    """A prefill rank's pieces of one request, streamed layer by layer (layerwise_transfer).

    ``add_layer`` gets each layer's rows of this rank (the plan's last chunk has just computed
    them: the rebalanced history then the chunk's rows, the holding's order) and sends them for
    every piece granted so far; a piece granted later first catches up on the computed layers.
    The positions go last (``finish``). A stream whose prefill failed (``fail``) sends zeros for
    whatever it cannot send, so no decode rank is left with a receive posted for a grant (the
    group tells it to drop the piece)."""

    def __init__(
        self,
        pieces: list[tuple[int, int]],
        receivers: tuple[int, ...],
        comm: CommGroup,
        tp: tuple[int, int],
        kv_heads: int,
        row: tuple[int, int, torch.dtype],
        layers: int,
    ) -> None:
        self.pieces, self.comm, self.layers = pieces, comm, layers
        self.routes = _routes(receivers, tp, kv_heads)
        self.row = row  # (this rank's KV heads, head dim, dtype)
        self.rows: list[torch.Tensor] = []  # per computed layer: [n, 2, heads, D]
        self.positions: torch.Tensor | None = None
        self.failed = False
        self.error: RuntimeError | None = None  # a send that could not start
        self.cancelled = False
        self.grants: dict[int, _Grant] = {}

    def grant(self, piece: int, tag: int) -> _Grant:
        """Piece ``piece`` may go, on tags from ``tag``: sends what is computed already."""
        grant = _Grant(tag, Sending([], []))
        self.grants[piece] = grant
        self._advance(piece, grant)
        return grant

    def add_layer(self, kv: torch.Tensor) -> None:
        self.rows.append(kv)
        for piece, grant in self.grants.items():
            self._advance(piece, grant)

    def finish(self, positions: torch.Tensor) -> list[int]:
        """Every layer is computed: the positions go; returns the pieces now wholly sent."""
        self.positions = positions
        return self._complete()

    def fail(self) -> list[int]:
        """The prefill failed: the granted pieces are filled up with zeros; returns them."""
        self.failed = True
        return self._complete()

    @property
    def broken(self) -> bool:
        """Its prefill failed, or a send could not start: what it sent is not the KV."""
        return self.failed or self.error is not None

    @property
    def settled(self) -> bool:
        """Nothing more to send: the prefill ran (or failed), and every piece is sent, or the
        request was cancelled (no more grants come) and its granted pieces are sent."""
        ran = self.positions is not None or self.failed
        granted = len(self.grants) == len(self.pieces) or self.cancelled
        return ran and granted and all(g.done for g in self.grants.values())

    def _complete(self) -> list[int]:
        out = []
        for piece, grant in self.grants.items():
            if not grant.done:
                self._advance(piece, grant)
                out.append(piece)
        return out

    def _advance(self, piece: int, grant: _Grant) -> None:
        start, count = self.pieces[piece]
        heads, head_dim, dtype = self.row
        while grant.layers < len(self.rows) or (self.failed and grant.layers < self.layers):
            if grant.layers < len(self.rows):
                kv = self.rows[grant.layers][start : start + count]
            else:
                kv = torch.zeros((count, 2, heads, head_dim), dtype=dtype)
            self._send(grant, kv, grant.tag + grant.layers, lambda b, h: b[:, :, h])
            grant.layers += 1
            grant.early += self.positions is None and not self.failed
        ready = self.positions is not None or self.failed
        if grant.layers == self.layers and ready and not grant.done:
            if self.positions is not None and not self.failed:
                pos = self.positions[start : start + count]
            else:
                pos = torch.zeros(count, dtype=torch.int64)
            self._send(grant, pos, grant.tag + TAG_STRIDE - 1, lambda b, h: b)
            grant.done = True

    def _send(self, grant: _Grant, rows: torch.Tensor, tag: int, cut: Any) -> None:
        for dst, local in self.routes:
            buf = cut(rows, local).contiguous()
            try:
                work = dist.isend(buf, self.comm.ranks[dst], self.comm.group, tag)
            except RuntimeError as exc:  # a decode rank is gone (the group ends): not sent
                self.error = self.error or exc
                continue
            grant.sending.buffers.append(buf)
            grant.sending.works.append(work)


@dataclass
class Posted:
    """A streamed piece's receives posted on a decode rank: per sender, a buffer per layer
    [rows, 2, heads, D], and the positions; ``error``: a receive that could not be posted (its
    sender is gone), raised when the piece completes."""

    works: list
    layers: list[list[torch.Tensor]]
    positions: torch.Tensor
    error: RuntimeError | None = None


def post_piece(
    src: int | list[tuple[int, int]],
    rows: int,
    comm: CommGroup,
    kv_cache: list[LayerKV],
    tag: int,
) -> Posted:
    """A decode rank posts the receives of a streamed piece (``receive_piece``'s senders),
    on tags from ``tag``; they complete in the background while the pool still computes."""
    k_cache = kv_cache[0][0]
    head_dim = k_cache.shape[3]
    posted = Posted([], [], torch.empty(rows, dtype=torch.int64))

    def receive(buf: torch.Tensor, peer: int, tag: int) -> None:
        try:
            posted.works.append(dist.irecv(buf, peer, comm.group, tag))
        except RuntimeError as exc:  # the sender is gone already: the piece fails when done
            posted.error = posted.error or exc

    for k, (rank, heads) in enumerate(_sources(src, k_cache.shape[1])):
        peer = comm.ranks[rank]
        bufs = [torch.empty((rows, 2, heads, head_dim), dtype=k_cache.dtype) for _ in kv_cache]
        for i, buf in enumerate(bufs):
            receive(buf, peer, tag + i)
        # Every sender sends the positions; the first sender's are kept.
        where = posted.positions if k == 0 else torch.empty(rows, dtype=torch.int64)
        receive(where, peer, tag + TAG_STRIDE - 1)
        posted.layers.append(bufs)
    return posted


def complete_piece(posted: Posted, kv_cache: list[LayerKV], block_ids: list[int]) -> None:
    """Wait for a posted piece (every receive, even after one fails: none stays posted) and
    write it into the paged ``kv_cache`` at the request's slots (``block_ids``; empty: drop)."""
    error = posted.error
    for work in posted.works:
        try:
            if work is not None:
                work.wait()
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
