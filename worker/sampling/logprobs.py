"""Log-probabilities of the chosen tokens and their top alternatives, from the raw model logits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from gearshift.worker.device_copy import tensor_on


@dataclass(frozen=True)
class TokenLogprobs:
    """The chosen token's logprob and rank, and the `n` most likely tokens (best first)."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: tuple[tuple[int, float], ...]


def compute_logprobs(
    raw_logits: Tensor, token_ids: Tensor, num_logprobs: Sequence[int | None]
) -> list[TokenLogprobs | None]:
    """One entry per row: None where the request asked for none.

    Taken from log_softmax of the logits before penalties, temperature and masks, which is what
    vLLM returns by default (the model's own belief, not the sampler's).
    """
    rows = [i for i, n in enumerate(num_logprobs) if n is not None]
    result: list[TokenLogprobs | None] = [None] * len(num_logprobs)
    if not rows:
        return result
    index = tensor_on(rows, torch.long, raw_logits.device)
    logprobs = raw_logits.index_select(0, index).to(torch.float32).log_softmax(dim=-1)
    chosen_ids = token_ids.index_select(0, index).unsqueeze(1)
    chosen = logprobs.gather(1, chosen_ids)
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    widest = max(num_logprobs[i] or 0 for i in rows)
    top_values, top_ids = (
        logprobs.topk(widest, dim=-1) if widest else (chosen[:, :0], chosen_ids[:, :0])
    )
    # One host transfer per tensor, not per row.
    chosen_list = chosen.squeeze(1).tolist()
    rank_list = ranks.tolist()
    id_list = chosen_ids.squeeze(1).tolist()
    values_list, ids_list = top_values.tolist(), top_ids.tolist()
    for j, row in enumerate(rows):
        n = num_logprobs[row] or 0
        top = tuple(zip(ids_list[j][:n], values_list[j][:n], strict=True))
        result[row] = TokenLogprobs(id_list[j], chosen_list[j], rank_list[j], top)
    return result
