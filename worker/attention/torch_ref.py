"""Reference attention over the paged KV cache, in plain torch; runs on every device.

Decodes are batched (one grouped matmul over each sequence's gathered context). Prefill chunks
without cached history run together as one right-padded causal SDPA call when their lengths are
close enough (``AttentionMetadata.prefill_plan``); the others run one by one through SDPA, with a
causal mask offset by the chunk's cached history.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gearshift.worker.attention.core import attention_lse
from gearshift.worker.attention.metadata import AttentionMetadata, PaddedPrefill
from gearshift.worker.kv.cache import LayerKV


def write_kv(kv: LayerKV, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store this step's keys/values [T, Hkv, D] at their slots (block-major, head-major blocks)."""
    k_cache, v_cache = kv
    block_size = k_cache.shape[2]
    if slot_mapping.numel() != k.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.numel()} slots for {k.shape[0]} tokens")
    if slot_mapping.numel() == 0:
        return
    # Rows without a slot (-1: padding) must write nothing, decided without reading the slots
    # on the host (a wait for the device each layer, and no CUDA graph could hold it): such a
    # row repeats the first real row's slot and values, so every duplicate write stores the
    # same thing. With no real row at all, every row writes back what its target holds.
    valid = slot_mapping >= 0
    first = valid.to(torch.uint8).argmax()
    src = torch.where(valid, torch.arange(valid.shape[0], device=valid.device), first)
    slots = slot_mapping.index_select(0, src)
    blocks = slots // block_size
    offsets = slots % block_size
    any_valid = valid.any()
    # Advanced indices on dims 0 and 2 around a slice: the indexed view is [T, Hkv, D].
    for cache, x in ((k_cache, k), (v_cache, v)):
        rows = x.index_select(0, src)
        cache[blocks, :, offsets] = torch.where(any_valid, rows, cache[blocks, :, offsets])


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first ``length`` cached positions as [Hkv, length, D]."""
    block_size = cache.shape[2]
    nblocks = -(-length // block_size)
    blocks = cache.index_select(0, block_table[:nblocks])  # [nb, H, bs, D]
    heads, dim = blocks.shape[1], blocks.shape[3]
    return blocks.transpose(0, 1).reshape(heads, nblocks * block_size, dim)[:, :length]


class TorchAttention:
    """The reference backend; ``forward`` writes this step's KV then attends over the cache."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] → [T, Hq, D]."""
        write_kv(kv, k, v, meta.slot_mapping)
        out = q.new_zeros(q.shape) if meta.num_padding else torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], kv, meta)
        self.prefill(q, k, v, kv, meta, out)
        return out

    def forward_lse(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` plus each row's log-sum-exp [T, Hq] (fp32), one sequence at a time.

        Plain softmax over explicit scores: the exact reference ring attention merges against.
        """
        write_kv(kv, k, v, meta.slot_mapping)
        tokens, hq, _ = q.shape
        out = q.new_zeros(q.shape)
        lse = torch.full((tokens, hq), float("-inf"), dtype=torch.float32, device=q.device)
        nd = meta.num_decodes
        pieces = _decode_runs(meta)
        # A prefill chunk's queries are its context's last positions: bottom-right causal.
        pieces += [
            (start, qlen, seq_len, meta.block_tables[nd + i], True)
            for i, (start, qlen, seq_len) in enumerate(
                zip(
                    meta.prefill_starts, meta.prefill_query_lens, meta.prefill_seq_lens, strict=True
                )
            )
        ]
        for start, qlen, seq_len, table, causal in pieces:
            keys = gather_context(kv[0], table, seq_len)  # [Hkv, L, D]
            values = gather_context(kv[1], table, seq_len)
            rows = slice(start, start + qlen)
            out[rows], lse[rows] = attention_lse(
                q[rows], keys.transpose(0, 1), values.transpose(0, 1), self.scale, causal
            )
        return out, lse

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        """Every prefill chunk's attention into its rows of ``out``; its KV is already cached.

        Chunks without cached history and of similar lengths run as one padded SDPA call
        (``meta.prefill_plan``); the others one by one.
        """
        nd = meta.num_decodes
        plan = meta.prefill_plan
        for batch in plan.batches:
            self._padded_prefill(q, k, v, batch, out)
        for i in plan.singles:
            start, qlen = meta.prefill_starts[i], meta.prefill_query_lens[i]
            seq_len = meta.prefill_seq_lens[i]
            sl = slice(start, start + qlen)
            if seq_len == qlen:
                # No cached history: the chunk attends to itself, causally.
                out[sl] = self._sdpa(q[sl], k[sl], v[sl], None)
            else:
                table = meta.block_tables[nd + i]
                keys = gather_context(kv[0], table, seq_len)
                values = gather_context(kv[1], table, seq_len)
                pos = torch.arange(seq_len - qlen, seq_len, device=q.device)
                mask = torch.arange(seq_len, device=q.device)[None, :] <= pos[:, None]
                out[sl] = self._sdpa(q[sl], keys, values, mask, heads_first=True)

    def _padded_prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: PaddedPrefill,
        out: torch.Tensor,
    ) -> None:
        n, length = batch.num_chunks, batch.max_len
        tokens, hq, dim = q.shape

        def padded(x: torch.Tensor) -> torch.Tensor:  # [T, H, D] → [n, H, length, D]
            if batch.dense and batch.row_range is not None:  # equal chunks back to back: a view
                start, end = batch.row_range
                return x[start:end].unflatten(0, (n, length)).transpose(1, 2)
            # Row gathers of 2-D views copy whole rows (several times faster than 3-D ones).
            rows = x.flatten(1).index_select(0, batch.gather)
            return rows.view(n, length, x.shape[1], dim).transpose(1, 2)

        # Right padding needs no key mask: a causal query never sees a later (padding) key.
        o = F.scaled_dot_product_attention(
            padded(q), padded(k), padded(v), is_causal=True, scale=self.scale, enable_gqa=True
        )
        if batch.dense and batch.row_range is not None:
            start, end = batch.row_range
            out[start:end] = o.transpose(1, 2).flatten(0, 1)
            return
        flat = o.transpose(1, 2).reshape(n * length, hq * dim)
        if batch.row_range is not None and out.is_contiguous():
            start, end = batch.row_range
            torch.index_select(flat, 0, batch.scatter, out=out.view(tokens, hq * dim)[start:end])
        else:
            out[batch.rows] = flat.index_select(0, batch.scatter).view(-1, hq, dim)

    def _sdpa(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        heads_first: bool = False,
    ) -> torch.Tensor:
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        kh = (k if heads_first else k.transpose(0, 1)).unsqueeze(0)
        vh = (v if heads_first else v.transpose(0, 1)).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=True
        )
        return o[0].transpose(0, 1)

    def _decode(self, q: torch.Tensor, kv: LayerKV, meta: AttentionMetadata) -> torch.Tensor:
        nd, hq, dim = q.shape
        k_cache, v_cache = kv
        hkv, block_size = k_cache.shape[1], k_cache.shape[2]
        nblocks = -(-meta.max_decode_seq_len // block_size)
        table = meta.block_tables[:nd, :nblocks].reshape(-1)
        length = nblocks * block_size
        # index_select gathers whole blocks several times faster than advanced indexing on CPU.
        keys = k_cache.index_select(0, table).view(nd, nblocks, hkv, block_size, dim)
        values = v_cache.index_select(0, table).view(nd, nblocks, hkv, block_size, dim)
        keys = keys.transpose(1, 2).reshape(nd, hkv, length, dim)
        values = values.transpose(1, 2).reshape(nd, hkv, length, dim)
        # Grouped-query attention without repeating KV: view the query heads of one KV head as
        # rows of one matmul.
        qg = q.view(nd, hkv, hq // hkv, dim)
        scores = torch.matmul(qg, keys.transpose(-1, -2)) * self.scale
        seq_lens = meta.seq_lens[:nd]
        invalid = torch.arange(length, device=q.device)[None, :] >= seq_lens[:, None]
        scores.masked_fill_(invalid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        return torch.matmul(probs, values).reshape(nd, hq, dim)


def _decode_runs(meta: AttentionMetadata) -> list[tuple[int, int, int, torch.Tensor, bool]]:
    """The step's decode rows as (first row, rows, context length, block table, causal=False):
    consecutive rows over one context (the same length and table; ring attention's query rows
    over one block, policies/tetris/block_attention.py) attend in one call, each seeing all of
    it."""
    nd = meta.num_decodes
    if not nd:
        return []
    lens, tables = meta.seq_lens[:nd], meta.block_tables[:nd]
    starts = [0]
    if nd > 1:
        same = (lens[1:] == lens[:-1]) & (tables[1:] == tables[:-1]).all(dim=1)
        starts += [i + 1 for i, s in enumerate(same.tolist()) if not s]
    ends = [*starts[1:], nd]
    firsts = lens[starts].tolist()
    return [(a, b - a, n, tables[a], False) for a, b, n in zip(starts, ends, firsts, strict=True)]
