"""Batched min-p / top-k / top-p masks: each sets filtered logits to -inf in place, per row.

Every function takes one parameter value per row, so one call serves a batch of requests with
different settings; a row whose value means "off" is left bit-for-bit unchanged, which keeps a
request's result independent of what else shares its batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

_NEG_INF = float("-inf")


def apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Drop tokens whose probability is below `min_p` times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1).to(probs.dtype)
    return logits.masked_fill_(probs < threshold, _NEG_INF)


def _top_k_off(top_k: Tensor, vocab_size: int) -> Tensor:
    return (top_k <= 0) | (top_k >= vocab_size)


def apply_top_k(logits: Tensor, top_k: Tensor) -> Tensor:
    """Keep the `top_k` largest logits of each row (ties with the k-th are kept); k <= 0 is off."""
    vocab_size = logits.shape[-1]
    off = _top_k_off(top_k, vocab_size)
    if bool(off.all()):
        return logits
    k = top_k.masked_fill(off, vocab_size).to(torch.long).clamp(1, vocab_size)
    # topk(max k) is far cheaper than a full sort of the vocabulary when k is small.
    values = logits.topk(int(k.max()), dim=-1).values
    kth = values.gather(1, (k - 1).clamp(max=values.shape[-1] - 1).unsqueeze(1))
    mask = (logits < kth) & ~off.unsqueeze(1)
    return logits.masked_fill_(mask, _NEG_INF)


def _top_p_sorted_mask(sorted_logits: Tensor, top_p: Tensor) -> Tensor:
    """Mask over descending-sorted logits keeping the smallest prefix whose mass reaches p."""
    probs = sorted_logits.softmax(dim=-1)
    # Mass strictly before each token; a shifted cumsum keeps the first entry exactly 0,
    # so the most likely token always survives.
    before = torch.cumsum(probs, dim=-1).roll(1, dims=-1)
    before[:, 0] = 0.0
    mask = before >= top_p.unsqueeze(1).to(probs.dtype)
    # p == 1 means off: rounding can push the cumulative sum past 1.0 in the tail.
    return mask & (top_p < 1.0).unsqueeze(1)


def apply_top_p(logits: Tensor, top_p: Tensor) -> Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches `top_p` (nucleus)."""
    return apply_top_k_top_p(logits, None, top_p)


def apply_top_k_top_p(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> Tensor:
    """Top-k then top-p (on the renormalised top-k distribution) with one sort of each row."""
    if top_p is None or not bool((top_p < 1.0).any()):
        return logits if top_k is None else apply_top_k(logits, top_k)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        vocab_size = logits.shape[-1]
        off = _top_k_off(top_k, vocab_size)
        k = top_k.masked_fill(off, vocab_size).to(torch.long).clamp(1, vocab_size)
        # Same threshold rule as apply_top_k (ties with the k-th kept), so a row gets the same
        # mask whichever path its batch takes.
        kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(
            (sorted_logits < kth) & ~off.unsqueeze(1), _NEG_INF
        )
    sorted_mask = _top_p_sorted_mask(sorted_logits, top_p) | (sorted_logits == _NEG_INF)
    mask = torch.empty_like(sorted_mask).scatter_(1, order, sorted_mask)
    return logits.masked_fill_(mask, _NEG_INF)
