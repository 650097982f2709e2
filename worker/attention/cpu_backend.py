"""Attention on CPU through the C++ kernels: decodes in one fused paged kernel, prefills via SDPA.

A decode step is one new token per sequence over a long cached context, where the reference's
gather + grouped matmul + masked softmax costs ~20 eager ops per layer; the kernel writes the new
KV and attends straight from the paged blocks. Prefill chunks are compute-bound and already run
well through SDPA, so they reuse the reference backend's prefill path unchanged.
"""

from __future__ import annotations

import torch

from gearshift.worker import kernels
from gearshift.worker.attention.metadata import AttentionMetadata
from gearshift.worker.attention.torch_ref import TorchAttention
from gearshift.worker.kv.cache import LayerKV


class CpuAttention:
    """An AttentionCore for CPU tensors; anything the kernels cannot take goes to the reference."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self.reference = TorchAttention(scale)

    def forward_lse(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's explicit-softmax attention with log-sum-exp (no kernel has it yet)."""
        return self.reference.forward_lse(q, k, v, kv, meta)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] → [T, Hq, D]; writes this step's KV into ``kv``."""
        if not kernels.usable(q):
            return self.reference.forward(q, k, v, kv, meta)
        k_cache, v_cache = kv
        nd, tokens = meta.num_decodes, q.shape[0]
        # Padding rows must read as zeros; every other row is written below.
        out = (q.new_zeros if meta.num_padding else q.new_empty)(q.shape)
        slots = meta.slot_mapping
        if nd:
            if tokens == nd:  # a pure decode step: no slicing (each slice is an eager op)
                dq, dk, dv, dout, dslots = q, k, v, out, slots
            else:
                dq, dk, dv, dout, dslots = q[:nd], k[:nd], v[:nd], out[:nd], slots[:nd]
            kernels.paged_decode_attention(
                dout,
                dq,
                dk,
                dv,
                k_cache,
                v_cache,
                dslots,
                meta.block_tables,
                meta.seq_lens,
                self.scale,
            )
        if tokens > nd:
            # Prefill chunks (and padding, slot -1): KV written here, attention by the reference.
            if nd:
                kernels.write_kv(k[nd:], v[nd:], k_cache, v_cache, slots[nd:])
            else:
                kernels.write_kv(k, v, k_cache, v_cache, slots)
            self.reference.prefill(q, k, v, kv, meta, out)
        return out
