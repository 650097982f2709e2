"""Attention through Triton kernels: the KV write, paged split-K decode and paged prefill/extend.

The kernels live in ``attention/triton/`` (one module per family) and are imported on first use,
so that importing gearshift never imports triton, and so that a process choosing Triton's
interpreter (``TRITON_INTERPRET=1``, CPU tensors) may set it any time before the first step.
"""

from __future__ import annotations

from types import ModuleType

import torch

from gearshift.worker.attention.metadata import AttentionMetadata
from gearshift.worker.kv.cache import LayerKV

# Multiprocessors assumed off CUDA (the interpreter), so it takes the split choices of an
# H100-class GPU (132 SMs) and tests exercise them.
DEFAULT_SMS = 132


class TritonAttention:
    """An AttentionCore of Triton kernels; ``forward_lse`` gives fp32 lse rows (ring merges).

    decode-only forward is capturable: for a step of decodes (and padding) only, ``forward`` and
    ``forward_lse`` read no device value on the host (no ``.item()``, ``.tolist()``,
    ``bool(tensor)``, ``nonzero`` or boolean-mask indexing) and allocate nothing whose shape
    depends on one. Every grid comes from tensor shapes (tokens, heads, the block table's width,
    the cache's block size), the host ints ``num_decodes`` and ``num_actual_tokens`` and the
    device's multiprocessor count; the number of KV splits is ``decode.num_splits`` of those. A
    sequence's actual length is read only on the device, so a CUDA graph captured for a batch-size
    bucket replays for any lengths that fit its block table. A bucket may pad with decode rows of
    ``seq_lens`` 0 and slot -1 (out 0, lse -inf, no KV written) or with padding tokens after the
    decodes (``num_padding``: out 0, lse -inf). Steps with prefill chunks copy one small [chunks, 3]
    tensor built from the metadata's host tuples to the device (once per step, shared by every
    layer), so they run eagerly.
    """

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self._sms: int | None = None
        self._ops: tuple[ModuleType, ModuleType, ModuleType] | None = None
        self._chunks: tuple[AttentionMetadata, torch.Tensor] | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] → [T, Hq, D]; writes this step's KV into ``kv`` first."""
        return self.forward_lse(q, k, v, kv, meta)[0]

    def forward_lse(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(out [T, Hq, D], lse [T, Hq] fp32); padding rows get out 0 and lse -inf."""
        write, decode, prefill = self._kernels()
        k_cache, v_cache = kv
        write.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        tokens, q_heads, _ = q.shape
        out = q.new_empty(q.shape)
        lse = torch.empty((tokens, q_heads), dtype=torch.float32, device=q.device)
        actual = meta.num_actual_tokens
        if actual < tokens:
            out[actual:].zero_()
            lse[actual:].fill_(float("-inf"))
        nd = meta.num_decodes
        if nd:
            splits = decode.num_splits(
                nd,
                k_cache.shape[1],
                meta.block_tables.shape[1],
                k_cache.shape[2],
                self._sm_count(q),
            )
            decode.paged_decode(
                q[:nd],
                k_cache,
                v_cache,
                meta.block_tables,
                meta.seq_lens,
                out[:nd],
                lse[:nd],
                self.scale,
                splits,
            )
        if meta.num_prefills:
            prefill.paged_prefill(
                q,
                k_cache,
                v_cache,
                meta.block_tables[nd:],
                self._chunk_table(meta, q.device),
                max(meta.prefill_query_lens),
                out,
                lse,
                self.scale,
            )
        return out, lse

    def _kernels(self) -> tuple[ModuleType, ModuleType, ModuleType]:
        if self._ops is None:
            from gearshift.worker.attention.triton import decode, kv_write, prefill

            self._ops = (kv_write, decode, prefill)
        return self._ops

    def _sm_count(self, q: torch.Tensor) -> int:
        if self._sms is None:
            if q.device.type == "cuda":
                props = torch.cuda.get_device_properties(q.device)
                self._sms = int(props.multi_processor_count)
            else:
                self._sms = DEFAULT_SMS
        return self._sms

    def _chunk_table(self, meta: AttentionMetadata, device: torch.device) -> torch.Tensor:
        """Each prefill chunk's (first row, query rows, context length) on the device, built once
        per step: every layer gets the same metadata object."""
        if self._chunks is None or self._chunks[0] is not meta:
            rows = list(
                zip(
                    meta.prefill_starts, meta.prefill_query_lens, meta.prefill_seq_lens, strict=True
                )
            )
            self._chunks = (meta, torch.tensor(rows, dtype=torch.int64, device=device))
        return self._chunks[1]
