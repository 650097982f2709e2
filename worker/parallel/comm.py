"""A process group seen from one rank: size, rank and the collectives the layers use.

``CommGroup.single()`` is the one-rank group; every collective on it is the identity, so the same
layer code runs in one process and across ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class CommGroup:
    """Ranks of one ``torch.distributed`` group, in group order."""

    size: int = 1
    rank: int = 0
    ranks: tuple[int, ...] = (0,)  # global ranks, index = group rank
    group: Any = field(default=None, compare=False, repr=False)

    @staticmethod
    def single() -> CommGroup:
        return CommGroup()

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim`` (all ranks get the result)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def gather_to_first(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor | None:
        """Concatenate along ``dim`` on group rank 0 only; other ranks get None."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=self.ranks[0], group=self.group)
        return torch.cat(parts, dim=dim) if parts is not None else None

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """Split dim 0 into ``size`` equal parts; part i goes to rank i (Ulysses' exchange)."""
        if self.size == 1:
            return x
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=self.group)
        return out
