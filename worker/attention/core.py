"""The attention interface every backend implements and every parallel layout wraps.

An ``AttentionCore`` runs attention after the QKV projection over a mixed batch of decodes and
prefill chunks and the paged KV cache, writing this step's keys and values first. ``forward_lse``
also returns each query row's log-sum-exp of its scaled scores, so attention computed over
disjoint pieces of a context can be merged exactly (ring attention, Tetris §2.3):
``out = Σ exp(lse_i − lse) · out_i`` with ``lse = logsumexp_i(lse_i)``.
``attention_lse`` is the cache-free piece such a merge is made of: query rows over one block of
keys, all visible or causally aligned to the block's end.
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


# Score elements (query heads × query rows × keys) one call materialises at most: 2^26 fp32
# scores are 256 MiB, and the probabilities as many again. Longer blocks run in row tiles.
MAX_SCORES = 1 << 26


def attention_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    max_scores: int = MAX_SCORES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Query rows q [n, Hq, D] over one block of keys/values [L, Hkv, D], no cache, fp32 math.

    ``causal`` places the n queries at the block's last n positions (query i sees keys up to
    L - n + i, flash-attention's bottom-right alignment); otherwise every key is visible. GQA
    groups consecutive query heads on one KV head. Returns (out [n, Hq, D] in q's dtype,
    lse [n, Hq] fp32); a row that sees no key gets out 0 and lse -inf.

    Rows are independent, so a block whose scores would exceed ``max_scores`` elements runs in
    tiles of rows (a causal tile needs only the keys up to its last row): a 16k-token prompt's
    attention then fits in memory.
    """
    n, hq = q.shape[0], q.shape[1]
    length = k.shape[0]
    rows = max(1, max_scores // max(1, hq * length))
    if n <= rows:
        return _attention_block(q, k, v, scale, causal)
    outs, lses = [], []
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        end = length - n + hi if causal else length  # keys the tile's last row may see
        out, lse = _attention_block(q[lo:hi], k[:end], v[:end], scale, causal)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def _attention_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    n, hq, dim = q.shape
    length, hkv = k.shape[0], k.shape[1]
    if n == 0 or length == 0:
        return q.new_zeros(q.shape), q.new_full((n, hq), float("-inf"), dtype=torch.float32)
    group = hq // hkv
    # Grouped query heads as rows of one matmul per KV head: no repeated KV.
    qg = q.float().view(n, hkv, group, dim).permute(1, 2, 0, 3).reshape(hkv, group * n, dim)
    keys = k.float().transpose(0, 1)  # [Hkv, L, D]
    values = v.float().transpose(0, 1)
    scores = torch.matmul(qg, keys.transpose(1, 2)).mul_(scale).view(hkv, group, n, length)
    if causal:
        pos = torch.arange(length - n, length, device=q.device)
        hidden = torch.arange(length, device=q.device)[None, :] > pos[:, None]  # [n, L]
        scores.masked_fill_(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [Hkv, group, n]
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    probs = torch.exp(scores - safe.unsqueeze(-1)).view(hkv, group * n, length)
    out = torch.matmul(probs, values).view(hkv, group, n, dim)
    out = out.permute(2, 0, 1, 3).reshape(n, hq, dim)
    return out.to(q.dtype), lse.permute(2, 0, 1).reshape(n, hq)
