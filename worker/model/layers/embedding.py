"""Vocabulary-parallel embedding and LM head: vocab rows split over the TP group."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gearshift.worker.comm import CommGroup
from gearshift.worker.errors import ModelLoadError
from gearshift.worker.model.layers.linear import pack_weight, packed_linear
from gearshift.worker.model.weights import LazyWeight


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose rows are split over TP; the vocab is padded to a multiple of TP."""

    def __init__(
        self, vocab_size: int, hidden: int, tp: CommGroup, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = tp
        self.per_rank = -(-vocab_size // tp.size)
        self.start = tp.rank * self.per_rank
        self.end = min(self.start + self.per_rank, vocab_size)
        self.weight = nn.Parameter(
            torch.empty((self.per_rank, hidden), dtype=dtype, device=device), requires_grad=False
        )

    def load_weight(self, name: str, w: LazyWeight) -> None:
        if w.shape[0] != self.vocab_size:
            raise ModelLoadError(
                f"{w.name}: vocab {w.shape[0]} != config vocab_size {self.vocab_size}"
            )
        rows = self.end - self.start
        self.weight.data[:rows].copy_(w.narrow(0, self.start, rows).load())
        self.weight.data[rows:].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.start) | (ids >= self.end)
        local = torch.where(outside, 0, ids - self.start)
        out = F.embedding(local, self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection over a vocab shard; full logits are assembled on the group's first rank."""

    packed: torch.Tensor | None = None

    def pack_weights(self, packing: str) -> None:
        if packing == "onednn":
            self.packed = pack_weight(self.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if self.packed is not None:
            local = packed_linear(hidden, self.packed, None)
        else:
            local = F.linear(hidden, self.weight)
        full = self.tp.gather_to_first(local, dim=-1)
        return None if full is None else full[..., : self.vocab_size]
