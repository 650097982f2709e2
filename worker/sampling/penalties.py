"""Repetition, presence and frequency penalties, batched over the rows that use them (as vLLM)."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import torch
from torch import Tensor

from gearshift.worker.device_copy import tensor_on, to_device


def token_counts(
    token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> Tensor:
    """[rows, vocab] float32 occurrence counts; ids outside the vocabulary are ignored."""
    counts = torch.zeros(len(token_lists), vocab_size, dtype=torch.float32, device=device)
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.long)
    if int(lengths.sum()) > 0:  # host tensors: no device read
        ids = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.long)
        rows = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
        # Tokenizers may hold added tokens past the model's (padded) vocabulary.
        keep = (ids >= 0) & (ids < vocab_size)
        ids, rows = ids[keep], rows[keep]
        # The (row, id) pairs cross once, without a wait; the [rows, vocab] counts never do.
        ones = torch.ones(ids.shape[0], dtype=torch.float32, device=device)
        counts.index_put_((to_device(rows, device), to_device(ids, device)), ones, accumulate=True)
    return counts


def apply_penalties(
    logits: Tensor,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    repetition_penalty: Sequence[float],
    presence_penalty: Sequence[float],
    frequency_penalty: Sequence[float],
) -> Tensor:
    """Penalise `logits` [rows, vocab] (fp32, in place) and return it.

    Repetition (CTRL paper, as in vLLM) divides positive and multiplies negative logits of every
    token seen in the prompt or output; presence and frequency (OpenAI) subtract
    `presence * [count > 0] + frequency * count` over output tokens only.
    """
    vocab_size = logits.shape[1]
    device = logits.device

    def column(values: Sequence[float]) -> Tensor:
        return tensor_on(values, torch.float32, device).unsqueeze(1)

    counts = token_counts(output_token_ids, vocab_size, device)
    if any(p != 1.0 for p in repetition_penalty):
        seen = (token_counts(prompt_token_ids, vocab_size, device) > 0) | (counts > 0)
        penalty = column(repetition_penalty)
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits.copy_(torch.where(seen, penalised, logits))
    if any(p != 0.0 for p in presence_penalty) or any(f != 0.0 for f in frequency_penalty):
        logits.sub_(column(frequency_penalty) * counts + column(presence_penalty) * (counts > 0))
    return logits
