"""RMSNorm, computed the way Hugging Face does (fp32 statistics, cast back before the weight)."""

from __future__ import annotations

import torch
from gearshift.worker.model.weights import LazyWeight
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(
            torch.empty(size, dtype=dtype, device=device), requires_grad=False
        )

    def load_weight(self, name: str, w: LazyWeight) -> None:
        self.weight.data.copy_(w.load())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)
