"""One ring step's attention through the rank's attention core (Tetris §2.3 on the engine's own
kernels: Triton's on a GPU, the torch reference elsewhere).

A ring step attends this member's query rows to one member's *block*: that member's history
rows, then its two zig-zag chunk shards o and 2N−1−o (the block's context order). Every query
row sees a prefix of that context:

- another member's block (o ≠ me): query shard a sees the history and each chunk shard b < a
  whole (the history precedes the chunk; shard b wholly precedes shard a). Since o < 2N−1−o,
  that is a prefix: the history, then shard o if o < a, then shard 2N−1−o if 2N−1−o < a.
- its own block (o = me): shard me sees the history and itself causally; shard 2N−1−me sees
  the history, shard me and itself causally: each a prefix that ends in its own rows.

So a block is one paged KV context (``paged_block``: keys and values in the cache layout
[pages, Hkv, PAGE, D] of one sequence) and travels round the ring as it is; a step is one
``forward_lse`` over it (``attend_block``). A prefix seen whole is a decode row per query (a
decode row sees its whole context); a prefix ending in the rows' own shard is a prefill chunk
(bottom-right causal, its queries the context's last rows).
"""

from __future__ import annotations

import torch

from gearshift.worker.attention.core import AttentionCore
from gearshift.worker.attention.metadata import AttentionMetadata
from gearshift.worker.policies.tetris.zigzag import ZigZag

PAGE = 16  # rows per page of a block: a block pads to a multiple of it


def pages(rows: int) -> int:
    return -(-rows // PAGE)


def block_shape(rows: int, kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """The shape of a block of ``rows`` context rows: [2 (k, v), pages, Hkv, PAGE, D]."""
    return (2, pages(rows), kv_heads, PAGE, head_dim)


def paged_block(
    history: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """A member's block from its history rows (k, v [H, Hkv, D]) and its chunk rows k/v
    [n, Hkv, D] (zig-zag local order): [2, pages, Hkv, PAGE, D], padded with zeros."""
    kv = torch.stack((torch.cat((history[0], k)), torch.cat((history[1], v))))  # [2, R, Hkv, D]
    rows, heads, dim = kv.shape[1], kv.shape[2], kv.shape[3]
    padded = pages(rows) * PAGE
    if padded != rows:
        kv = torch.cat((kv, kv.new_zeros((2, padded - rows, heads, dim))), dim=1)
    return kv.view(2, padded // PAGE, PAGE, heads, dim).transpose(2, 3).contiguous()


def attend_block(
    core: AttentionCore,
    q: torch.Tensor,
    block: torch.Tensor,
    origin: int,
    me: int,
    layout: ZigZag,
    history_rows: int,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Member ``me``'s queries q [n, Hq, D] (its zig-zag rows) over ``origin``'s block, whose
    first ``history_rows`` rows are history: (out [n, Hq, D], lse [n, Hq] fp32), or None when
    no row sees any key of it."""
    n = q.shape[0]
    if n == 0:
        return None
    first, second = layout.shards(me)
    s1 = layout.span(first)[1] - layout.span(first)[0]
    s2 = n - s1
    device = q.device
    if origin == me:
        chunks = [(0, s1, history_rows + s1)] if s1 else []
        if s2:
            chunks.append((s1, s2, history_rows + s1 + s2))
        meta = AttentionMetadata(
            num_decodes=0,
            slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=device),
            block_tables=_table(block, len(chunks), device),
            seq_lens=torch.tensor([c[2] for c in chunks], dtype=torch.int64, device=device),
            max_decode_seq_len=0,
            prefill_starts=tuple(c[0] for c in chunks),
            prefill_query_lens=tuple(c[1] for c in chunks),
            prefill_seq_lens=tuple(c[2] for c in chunks),
        )
    else:
        o_first, o_second = layout.shards(origin)
        o1 = layout.span(o_first)[1] - layout.span(o_first)[0]
        o2 = layout.local_length(origin) - o1

        def seen(shard: int) -> int:
            return history_rows + (o1 if o_first < shard else 0) + (o2 if o_second < shard else 0)

        a, b = seen(first), seen(second)
        if a == b == 0:
            return None
        lens = torch.tensor([a] * s1 + [b] * s2, dtype=torch.int64, device=device)
        meta = AttentionMetadata(
            num_decodes=n,
            slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=device),
            block_tables=_table(block, n, device),
            seq_lens=lens,
            max_decode_seq_len=max(a, b),
            prefill_starts=(),
            prefill_query_lens=(),
            prefill_seq_lens=(),
        )
    # The block is already in the cache: slots -1 write nothing, so k/v are placeholders.
    nothing = q.new_zeros((n, block.shape[2], q.shape[2]))
    return core.forward_lse(q, nothing, nothing, (block[0], block[1]), meta)


def _table(block: torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    """Every sequence's block table: the block's pages in order (one row, repeated)."""
    return torch.arange(block.shape[1], dtype=torch.int64, device=device).expand(rows, -1)
