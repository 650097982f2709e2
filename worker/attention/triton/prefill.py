"""Paged prefill/extend attention: chunks of a mixed batch over their cached prefix and themselves.

FlashAttention-2's forward (Dao 2023, Alg. 1) over a paged cache: a program takes a tile of a
chunk's query rows for one query head, walks the chunk's context in key tiles with the online
softmax, and writes the tile's output and log-sum-exp. A chunk's keys and values have been written
to its pages before this runs, so the cached prefix and the chunk itself are one paged context.

Query row i of a chunk of n rows over a context of L keys sits at position L − n + i and sees keys
0..L − n + i (bottom-right causal alignment, as ``attention_lse``). Keys up to the tile's first row
are visible to every row of the tile and need no mask; only the tiles after them are masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gearshift.worker.attention.triton.decode import LOG2E
from gearshift.worker.attention.triton.jit import kernel, unit_last


def _prefill(
    q_ptr,
    k_cache,
    v_cache,
    block_tables,
    chunks,
    out_ptr,
    lse_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_kcb,
    stride_kch,
    stride_kcp,
    stride_vcb,
    stride_vch,
    stride_vcp,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    chunk = tl.program_id(0)
    first = tl.program_id(1) * BLOCK_M
    head = tl.program_id(2)
    start = tl.load(chunks + chunk * 3)
    qlen = tl.load(chunks + chunk * 3 + 1)
    seq_len = tl.load(chunks + chunk * 3 + 2)
    if first < qlen:
        history = seq_len - qlen
        kv_head = head // GROUP
        rows = first + tl.arange(0, BLOCK_M)
        row_mask = rows < qlen
        positions = history + rows
        dims = tl.arange(0, BLOCK_D)
        dim_mask = dims < HEAD_DIM
        q = tl.load(
            q_ptr + (start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :],
            mask=row_mask[:, None] & dim_mask[None, :],
            other=0.0,
        )
        table = block_tables + chunk * stride_bt
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)  # noqa: E741 (the paper's name)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # Keys 0..open_end-1 are visible to every row of the tile (whole tiles of them).
        open_end = (history + first + 1) // BLOCK_N * BLOCK_N
        # One past the last key any real row of the tile sees.
        last = tl.minimum(history + first + BLOCK_M, seq_len)
        for n0 in range(0, last, BLOCK_N):
            keys = n0 + tl.arange(0, BLOCK_N)
            key_mask = keys < last
            pages = tl.load(table + keys // PAGE, mask=key_mask, other=0)
            offsets = keys % PAGE
            kv_mask = key_mask[:, None] & dim_mask[None, :]
            k = tl.load(
                k_cache
                + pages[:, None] * stride_kcb
                + kv_head * stride_kch
                + offsets[:, None] * stride_kcp
                + dims[None, :],
                mask=kv_mask,
                other=0.0,
            )
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
            if n0 >= open_end:  # the causal edge: row i sees keys up to its position
                visible = key_mask[None, :] & (keys[None, :] <= positions[:, None])
                s = tl.where(visible, s, float("-inf"))
            # Key 0 is in the first tile and visible to every row, so m stays finite from there.
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)  # noqa: E741
            v = tl.load(
                v_cache
                + pages[:, None] * stride_vcb
                + kv_head * stride_vch
                + offsets[:, None] * stride_vcp
                + dims[None, :],
                mask=kv_mask,
                other=0.0,
            )
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        seen = l > 0.0
        out = acc / tl.where(seen, l, 1.0)[:, None]
        lse = tl.where(
            seen, (m + tl.log2(tl.where(seen, l, 1.0))) * 0.6931471805599453, float("-inf")
        )
        out_rows = out_ptr + (start + rows) * stride_ot + head * stride_oh
        tl.store(
            out_rows[:, None] + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & dim_mask[None, :],
        )
        tl.store(lse_ptr + (start + rows) * stride_lt + head * stride_lh, lse, mask=row_mask)


def prefill_tiles(dim: int, itemsize: int, on_gpu: bool) -> tuple[int, int, int]:
    """(query rows, keys, warps) per program for a padded head dimension ``dim``."""
    if not on_gpu:  # the interpreter: few, large programs (each op is a numpy call)
        return 64, 64, 4
    if itemsize > 2:  # fp32 (tests): half the tiles keep the shared memory of sm_80's limit
        return 64, 32, 4
    if dim <= 64:
        return 128, 64, 4
    if dim <= 128:
        return 128, 64, 8
    return 64, 32, 8


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    chunks: torch.Tensor,
    longest: int,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
) -> None:
    """Prefill chunks' rows of q [T, Hq, D] over their paged contexts into out/lse rows.

    ``chunks`` [P, 3] int64 (device) holds each chunk's (first row, query rows, context length
    including the chunk); chunk c's pages are ``block_tables`` row c; ``longest`` is the most
    query rows of a chunk (a host int: it sizes the grid).
    """
    count = chunks.shape[0]
    if count == 0 or longest == 0:
        return
    q_heads, dim = q.shape[1], q.shape[2]
    kv_heads, page = k_cache.shape[1], k_cache.shape[2]
    q = unit_last(q)
    block_d = max(16, triton.next_power_of_2(dim))
    block_m, block_n, warps = prefill_tiles(block_d, q.element_size(), q.device.type == "cuda")
    # Short chunks (mixed batches) take a smaller query tile instead of padding it.
    block_m = max(16, min(block_m, triton.next_power_of_2(longest)))
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    kernel(_prefill)[(count, triton.cdiv(longest, block_m), q_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
        chunks,
        out,
        lse,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        lse.stride(1),
        GROUP=q_heads // kv_heads,
        HEAD_DIM=dim,
        PAGE=page,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        PRECISION=precision,
        num_warps=warps,
        num_stages=2,
    )
