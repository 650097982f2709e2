"""A process group seen from one rank: size, rank and the collectives the layers use.

``CommGroup.single()`` is the one-rank group; every collective on it is the identity, so the same
layer code runs in one process and across ranks.

gloo moves CPU tensors only (its CUDA support stops at all-reduce and broadcast). Ranks pinned to
one shared GPU run gloo (``launch/rank.group_backend``, ``device: cuda:N``), so their device
tensors cross through host memory (``via_host``). That path is for correctness on a one-GPU
machine, not for speed. NCCL takes device tensors as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


def via_host(device: torch.device, group: Any = None) -> bool:
    """Whether tensors on ``device`` cross ``group`` (None: the default group) through host
    memory."""
    return device.type != "cpu" and dist.get_backend(group) == "gloo"


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
            if via_host(x.device, self.group):
                host = x.contiguous().cpu()
                dist.all_reduce(host, group=self.group)
                x.copy_(host)
            else:
                dist.all_reduce(x, group=self.group)
        return x

    def _logical(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        # torch.distributed orders a group's members by global rank; ours may differ (the shift
        # gear's SP_TP order), so per-rank results are put back in our order.
        by_global = dict(zip(sorted(self.ranks), parts, strict=True))
        return [by_global[r] for r in self.ranks]

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim`` in group order (all ranks get it)."""
        if self.size == 1:
            return x
        device = x.device
        x = x.contiguous().cpu() if via_host(x.device, self.group) else x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(self._logical(parts), dim=dim).to(device)

    def gather_to_first(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor | None:
        """Concatenate along ``dim`` in group order on group rank 0 only; others get None."""
        if self.size == 1:
            return x
        device = x.device
        x = x.contiguous().cpu() if via_host(x.device, self.group) else x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=self.ranks[0], group=self.group)
        return torch.cat(self._logical(parts), dim=dim).to(device) if parts is not None else None

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """Split dim 0 into ``size`` equal parts; part i goes to rank i (Ulysses' exchange)."""
        if self.size == 1:
            return x
        # Only groups whose order is ascending global rank (SP groups and their subgroups).
        assert list(self.ranks) == sorted(self.ranks), "all_to_all needs an ascending group"
        # empty_like would copy a transposed input's strides; the collective writes row-major.
        device = x.device
        x = x.contiguous().cpu() if via_host(x.device, self.group) else x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=self.group)
        return out.to(device)

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            if via_host(x.device, self.group):
                host = x.contiguous().cpu()
                dist.broadcast(host, src=self.ranks[0], group=self.group)
                x.copy_(host)
            else:
                dist.broadcast(x, src=self.ranks[0], group=self.group)
        return x
