"""Random mixed batches over a scattered paged cache, for the triton backend's tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gearshift.worker.attention.metadata import AttentionMetadata
from gearshift.worker.kv.cache import LayerKV
from tests.worker.helpers import scattered_block_tables


@dataclass
class Batch:
    """One step's q/k/v, its metadata and a cache whose unused slots hold random values."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    meta: AttentionMetadata
    k_cache: torch.Tensor
    v_cache: torch.Tensor

    def kv(self) -> LayerKV:
        """A fresh copy of the cache (each backend writes this step's KV into its own)."""
        return self.k_cache.clone(), self.v_cache.clone()


def make_batch(
    decode_lens: list[int],
    chunks: list[tuple[int, int]],
    *,
    kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    padding: int = 0,
    spare_blocks: int = 3,
    spare_width: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> Batch:
    """Decodes of context ``decode_lens`` (this step's token included), then prefill chunks of
    (query rows, context length incl. the chunk), then ``padding`` tokens (slot -1).

    Blocks come from a random permutation of the pool, so a kernel that assumed ordered blocks
    reads the wrong keys; cached positions are random and this step's positions get written.
    ``spare_width`` widens the block table beyond the longest context (as a CUDA graph bucket's
    static table is).
    """
    g = torch.Generator().manual_seed(seed)
    lens = decode_lens + [total for _, total in chunks]
    blocks = sum(-(-n // block_size) for n in lens) + spare_blocks
    width = max(-(-n // block_size) for n in lens) + spare_width
    tables = scattered_block_tables(lens, block_size, blocks, width, g)
    shape = (blocks, kv_heads, block_size, head_dim)
    k_cache = torch.randn(shape, generator=g)
    v_cache = torch.randn(shape, generator=g)
    slots: list[int] = []
    for i, n in enumerate(decode_lens):
        slots.append(_slot(tables[i], n - 1, block_size))
    starts: list[int] = []
    row = len(decode_lens)
    for c, (qlen, total) in enumerate(chunks):
        starts.append(row)
        table = tables[len(decode_lens) + c]
        slots.extend(_slot(table, p, block_size) for p in range(total - qlen, total))
        row += qlen
    slots.extend([-1] * padding)
    tokens = len(slots)
    q = torch.randn(tokens, kv_heads * group, head_dim, generator=g)
    k = torch.randn(tokens, kv_heads, head_dim, generator=g)
    v = torch.randn(tokens, kv_heads, head_dim, generator=g)
    meta = AttentionMetadata(
        num_decodes=len(decode_lens),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=tables.to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int64, device=device),
        max_decode_seq_len=max(decode_lens, default=0),
        prefill_starts=tuple(starts),
        prefill_query_lens=tuple(q for q, _ in chunks),
        prefill_seq_lens=tuple(t for _, t in chunks),
        num_padding=padding,
    )

    def put(x: torch.Tensor) -> torch.Tensor:
        return x.to(device=device, dtype=dtype)

    return Batch(put(q), put(k), put(v), meta, put(k_cache), put(v_cache))


def _slot(table: torch.Tensor, position: int, block_size: int) -> int:
    return int(table[position // block_size]) * block_size + position % block_size
