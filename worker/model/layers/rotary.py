"""Rotary position embedding (Hugging Face's rotate-half form) with linear and llama3 scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from gearshift.worker import kernels
from gearshift.worker.model.config import RopeConfig


def inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Per-pair inverse frequencies after scaling, in fp32."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.kind == "linear":
        return inv / rope.factor
    if rope.kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by ``factor``, short ones kept, and the band
        # between the two cut-offs is interpolated smoothly.
        old = rope.original_max_position
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to ``max_positions``, indexed per token."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        rope: RopeConfig,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        inv = inverse_frequencies(head_dim, rope)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)
        self.register_buffer("cos", freqs.cos().to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin", freqs.sin().to(dtype=dtype, device=device), persistent=False)

    def table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, 1, D/2] for ``positions`` [T]: gathered once per step for every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate heads ``x`` [T, H, D] into a new tensor; q and k heads may go together in one call."""
    if (
        x.dim() == 3
        and cos.dtype == x.dtype
        and cos.shape[0] == x.shape[0]
        and cos.numel() == x.shape[0] * (x.shape[2] // 2)
        and kernels.usable(x)
    ):
        return kernels.rotary_embedding(x, cos, sin)
    return rotate_reference(x, cos, sin)


def rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's rotate-half in torch: each product rounded to the dtype, then the sum."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
