"""The attention interface every backend implements and every parallel layout wraps.

An ``AttentionCore`` runs attention after the QKV projection over a mixed batch of decodes and
prefill chunks and the paged KV cache, writing this step's keys and values first. ``forward_lse``
also returns each query row's log-sum-exp of its scaled scores, so attention computed over
disjoint pieces of a context can be merged exactly (ring attention, Tetris §2.3):
``out = Σ exp(lse_i − lse) · out_i`` with ``lse = logsumexp_i(lse_i)``.
"""

from __future__ import annotations

from typing import Protocol

import torch

from gearshift.worker.attention.metadata import AttentionMetadata
from gearshift.worker.kv.cache import LayerKV


class AttentionCore(Protocol):
    """Attention after the QKV projection: q [T, Hq, D], k/v [T, Hkv, D] → [T, Hq, D]."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
    ) -> torch.Tensor: ...

    def forward_lse(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(out [T, Hq, D], lse [T, Hq] fp32); padding rows get out 0 and lse -inf."""
        ...


def merge_partials(
    outs: list[torch.Tensor], lses: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over disjoint key sets: (out [T, H, D], lse [T, H]) from the parts.

    Rows where every part saw no key (lse -inf everywhere) come out as 0 with lse -inf.
    """
    stacked = torch.stack(lses)  # [P, T, H]
    lse = torch.logsumexp(stacked, dim=0)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    weights = torch.exp(stacked - safe)  # exp(-inf) = 0 for empty parts
    out = sum(
        (w.unsqueeze(-1) * o.float() for w, o in zip(weights, outs, strict=True)),
        start=torch.zeros_like(outs[0], dtype=torch.float32),
    )
    return out.to(outs[0].dtype), lse
