"""The write of a step's keys and values into their pages of the paged KV cache.

One program per token stores every KV head of the token at its slot (block = slot // block_size,
offset = slot % block_size in a [blocks, kv_heads, block_size, D] cache). A padding token
(slot -1) stores nothing; the mask decides on the device, so the write never syncs the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gearshift.worker.attention.triton.jit import kernel, unit_last


def _write_kv(
    k_ptr,
    v_ptr,
    k_cache,
    v_cache,
    slot_mapping,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kch,
    stride_kcp,
    stride_vcb,
    stride_vch,
    stride_vcp,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t)
    # A padding token writes no head (a block mask, not scalar & block: the interpreter of
    # triton 3.9 gives the latter the wrong dtype).
    heads_written = tl.where(slot >= 0, KV_HEADS, 0)
    slot = tl.maximum(slot, 0)  # an in-range address for padding, though nothing is written
    page = slot // PAGE
    offset = slot % PAGE
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < heads_written) & (dims[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    k_dst = k_cache + page * stride_kcb + heads[:, None] * stride_kch + offset * stride_kcp
    v_dst = v_cache + page * stride_vcb + heads[:, None] * stride_vch + offset * stride_vcp
    tl.store(k_dst + dims[None, :], k, mask=mask)
    tl.store(v_dst + dims[None, :], v, mask=mask)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store k/v [T, Hkv, D] at ``slot_mapping`` [T] (int64, -1 writes nothing); no host sync."""
    tokens, kv_heads, dim = k.shape
    if slot_mapping.shape != (tokens,):
        raise ValueError(f"slot_mapping has shape {tuple(slot_mapping.shape)} for {tokens} tokens")
    if tokens == 0:
        return
    k, v = unit_last(k), unit_last(v)
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV cache's head dimension must be contiguous")
    kernel(_write_kv)[(tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        KV_HEADS=kv_heads,
        HEAD_DIM=dim,
        PAGE=k_cache.shape[2],
        BLOCK_H=triton.next_power_of_2(kv_heads),
        BLOCK_D=triton.next_power_of_2(dim),
    )
