"""Paged decode attention: one query token per sequence over its cached context, split-K.

Flash-decoding (Dao et al., "Flash-Decoding for long-context inference", 2023): a decode has one
query row, so a program per (sequence, head) leaves a GPU idle at small batches. The context is
cut into ``splits`` ranges of whole key tiles; each program attends to one range with the online
softmax of FlashAttention-2 (Dao 2023, Alg. 1) and writes its normalised output and log-sum-exp,
and a second kernel merges the ranges: ``out = Σ exp(lse_s − lse) · out_s``,
``lse = logsumexp_s(lse_s)`` (the merge of ``attention/core.py``).

GQA: a program owns one KV head and the query heads grouped on it (padded to a 16-row tile so
``tl.dot`` runs on tensor cores), so each key is read once per group, not once per query head.

Every launch size is a function of tensor shapes and of the device, never of device values: a
sequence's actual length only decides, inside the kernel, which of its ranges hold keys (the rest
store lse -inf, which the merge weighs 0). That keeps a decode step capturable in a CUDA graph.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from gearshift.worker.attention.triton.jit import kernel, unit_last

# A range shorter than this costs more in the merge and in launch than its parallelism gains.
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 32
# Query heads of one KV head per program at most (registers: a [64, D] fp32 accumulator).
MAX_GROUP_ROWS = 64
LOG2E = 1.0 / math.log(2.0)


def num_splits(decodes: int, kv_heads: int, table_width: int, page: int, sms: int) -> int:
    """Ranges per sequence: about two programs per multiprocessor over (decodes x KV heads x
    ranges), none shorter than MIN_SPLIT_TOKENS of the longest context the block table holds.
    Every argument is a shape or a device property, so the count is fixed for a graph bucket."""
    by_length = -(-table_width * page // MIN_SPLIT_TOKENS)
    by_occupancy = -(-2 * sms // max(1, decodes * kv_heads))
    return max(1, min(MAX_SPLITS, by_length, by_occupancy))


def _decode_split(
    q_ptr,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
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
    stride_os,
    stride_lt,
    stride_lh,
    stride_ls,
    GROUP: tl.constexpr,
    HEAD_CHUNKS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_CHUNKS
    rows = (tl.program_id(1) % HEAD_CHUNKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + seq)
    # Whole key tiles per range; ranges past the context are empty.
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    row_mask = rows < GROUP
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    table = block_tables + seq * stride_bt
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)  # noqa: E741 (the paper's name)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        key_mask = keys < end
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
        # Scores in base 2 (scale·log2 e folded in): exp2 is the hardware's exponential.
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        s = tl.where(key_mask[None, :], s, float("-inf"))
        # Every tile holds a visible key, so m_new is finite and nothing below is NaN.
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
    out = tl.where(seen[:, None], acc / tl.where(seen, l, 1.0)[:, None], 0.0)
    lse = tl.where(seen, (m + tl.log2(tl.where(seen, l, 1.0))) * 0.6931471805599453, float("-inf"))
    out_row = out_ptr + seq * stride_ot + split * stride_os + heads * stride_oh
    tl.store(
        out_row[:, None] + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )
    tl.store(lse_ptr + seq * stride_lt + split * stride_ls + heads * stride_lh, lse, mask=row_mask)


def _merge_splits(
    part_out,
    part_lse,
    out_ptr,
    lse_ptr,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_plt,
    stride_plh,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    split_mask = splits < NUM_SPLITS
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    lses = tl.load(
        part_lse + seq * stride_plt + head * stride_plh + splits,
        mask=split_mask,
        other=float("-inf"),
    )
    top = tl.max(lses, 0)
    # A sequence without keys (length 0: a padding row) has every lse -inf: out 0, lse -inf.
    top = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp(lses - top)
    total = tl.sum(weights, 0)
    parts = tl.load(
        part_out + seq * stride_pt + head * stride_ph + splits[:, None] * stride_ps + dims[None, :],
        mask=split_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    seen = total > 0.0
    out = tl.sum(parts * weights[:, None], 0) / tl.where(seen, total, 1.0)
    lse = tl.where(seen, top + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    tl.store(
        out_ptr + seq * stride_ot + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )
    tl.store(lse_ptr + seq * stride_lt + head * stride_lh, lse)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    splits: int,
) -> None:
    """Decode rows q [B, Hq, D] over their cached contexts (this step's KV already written) into
    out [B, Hq, D] and lse [B, Hq] (fp32); a row whose ``seq_lens`` is 0 gets 0 and -inf.

    ``block_tables`` [≥B, width] and ``seq_lens`` [≥B] (int64) are read at rows 0..B-1.
    """
    decodes, q_heads, dim = q.shape
    if decodes == 0:
        return
    kv_heads, page = k_cache.shape[1], k_cache.shape[2]
    group = q_heads // kv_heads
    q = unit_last(q)
    block_h = max(16, min(MAX_GROUP_ROWS, triton.next_power_of_2(group)))
    head_chunks = -(-group // block_h)
    block_d = max(16, triton.next_power_of_2(dim))
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    if splits == 1:  # one range: the first kernel writes the answer
        part_out, part_lse = out, lse
        out_strides = (out.stride(0), out.stride(1), 0)
        lse_strides = (lse.stride(0), lse.stride(1), 0)
    else:
        part_out = torch.empty(
            (decodes, q_heads, splits, dim), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty((decodes, q_heads, splits), dtype=torch.float32, device=q.device)
        out_strides = (part_out.stride(0), part_out.stride(1), part_out.stride(2))
        lse_strides = (part_lse.stride(0), part_lse.stride(1), part_lse.stride(2))
    kernel(_decode_split)[(decodes, kv_heads * head_chunks, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        part_out,
        part_lse,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        *out_strides,
        *lse_strides,
        GROUP=group,
        HEAD_CHUNKS=head_chunks,
        HEAD_DIM=dim,
        PAGE=page,
        NUM_SPLITS=splits,
        BLOCK_H=block_h,
        BLOCK_N=64 if block_d <= 128 else 32,
        BLOCK_D=block_d,
        PRECISION=precision,
        num_warps=4,
        num_stages=2,
    )
    if splits == 1:
        return
    kernel(_merge_splits)[(decodes, q_heads)](
        part_out,
        part_lse,
        out,
        lse,
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        lse.stride(1),
        NUM_SPLITS=splits,
        HEAD_DIM=dim,
        BLOCK_S=triton.next_power_of_2(splits),
        BLOCK_D=block_d,
        num_warps=4 if block_d >= 128 else 2,
    )
