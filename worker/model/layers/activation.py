"""SwiGLU's activation: silu(gate) * up over a fused gate|up projection output."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gearshift.worker import kernels


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2I] (gate | up) → [..., I], rounded like Hugging Face (silu, then the product)."""
    if kernels.usable(x):
        return kernels.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
