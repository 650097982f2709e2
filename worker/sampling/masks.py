"""Batched min-p / top-k / top-p masks: each sets filtered logits to -inf in place, per row.

Every function takes one parameter value per row, so one call serves a batch of requests with
different settings; a row whose value means "off" is left bit-for-bit unchanged, which keeps a
request's result independent of what else shares its batch.

The sampler passes what it knows on the host (the largest k, whether any row uses top-p) so that
nothing here reads a device value: a read would make the host wait for the whole step. Called
without those hints, the functions read them from the tensors.
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


def apply_top_k(logits: Tensor, top_k: Tensor, max_k: int | None = None) -> Tensor:
    """Keep the `top_k` largest logits of each row (ties with the k-th are kept); k <= 0 is off.

    ``max_k``: the largest k of the rows where top-k is on (from the host; None reads it).
    """
    vocab_size = logits.shape[-1]
    off = _top_k_off(top_k, vocab_size)
    if max_k is None:
        if bool(off.all()):
            return logits
        max_k = int(top_k.masked_fill(off, 1).clamp(1, vocab_size).max())
    k = top_k.masked_fill(off, vocab_size).to(torch.long).clamp(1, vocab_size)
    # topk(max k) is far cheaper than a full sort of the vocabulary when k is small; rows with
    # top-k off are left alone by the mask below, whatever their gathered k-th value.
    values = logits.topk(max(1, min(max_k, vocab_size)), dim=-1).values
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


def apply_top_k_top_p(
    logits: Tensor,
    top_k: Tensor | None,
    top_p: Tensor | None,
    max_k: int | None = None,
    top_p_on: bool | None = None,
) -> Tensor:
    """Top-k then top-p (on the renormalised top-k distribution) with one sort of each row.

    ``max_k`` as in ``apply_top_k``; ``top_p_on``: whether some row has p < 1 (None reads it).
    """
    if top_p is not None and top_p_on is None:
        top_p_on = bool((top_p < 1.0).any())
    if top_p is None or not top_p_on:
        return logits if top_k is None else apply_top_k(logits, top_k, max_k)
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
