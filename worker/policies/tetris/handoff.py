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
whole request at once (no handshake) for tools and tests. Not here: streaming a layer's KV while
later layers still run (``layerwise_transfer``; the policy refuses it).
"""

from __future__ import annotations

from dataclasses import dataclass

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
    table = torch.tensor(block_ids, dtype=torch.int64)
    for kv, pos in pieces:
        if int(pos.max()) >= len(block_ids) * block_size:
            raise ValueError(f"position {int(pos.max())} lies beyond the request's blocks")
        slots = table[pos // block_size] * block_size + pos % block_size
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
    j, prefill_tp = tp
    total = rows.kv.shape[3] if kv_heads is None else kv_heads
    base = kv_heads_of(j, prefill_tp, total).start
    sending = Sending([], [])
    for t, dst in enumerate(receivers):
        heads = head_route(j, prefill_tp, t, len(receivers), total)
        if heads is None:
            continue
        local = slice(heads.start - base, heads.stop - base)
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
    sources = [(src, local_heads)] if isinstance(src, int) else src
    if sum(n for _, n in sources) != local_heads:
        raise ValueError(f"the senders' heads {sources} do not make this rank's {local_heads}")
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
    if rows and int(pos.max()) >= len(block_ids) * block_size:
        raise ValueError(f"position {int(pos.max())} lies beyond the request's blocks")
    table = torch.tensor(block_ids, dtype=torch.int64)
    slots = table[pos // block_size] * block_size + pos % block_size
    for layer, cache in enumerate(kv_cache):
        write_kv(cache, kv[:, layer, 0], kv[:, layer, 1], slots)
