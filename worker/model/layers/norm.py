"""RMSNorm, computed the way Hugging Face does (fp32 statistics, cast back before the weight).

On CPU the C++ kernels (gearshift.worker.kernels) do it in one pass with the same rounding; the
torch code is the reference everywhere else.
"""

from __future__ import annotations

import torch
from torch import nn

from gearshift.worker import kernels
from gearshift.worker.model.layers import fused_triton
from gearshift.worker.model.weights import LazyWeight


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.fused = False  # the Triton kernel on CUDA (model/fused_ops.py decides)
        self.weight = nn.Parameter(
            torch.empty(size, dtype=dtype, device=device), requires_grad=False
        )

    def load_weight(self, name: str, w: LazyWeight) -> None:
        self.weight.data.copy_(w.load())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and self._fusable(x):
            return fused_triton.rms_norm(x, self.weight, self.eps)
        if self.weight.dtype == x.dtype and kernels.usable(x):
            return kernels.rms_norm(x, self.weight, self.eps)
        return self.reference(x)

    def _fusable(self, *xs: torch.Tensor) -> bool:
        # Rows of 2-D tensors with unit column stride (q/k norms over heads are 3-D). ``fused``
        # is set on CUDA only (fused_ops); tests set it on CPU under Triton's interpreter.
        return all(t.dim() == 2 and t.stride(-1) == 1 and t.dtype == self.weight.dtype for t in xs)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), the sum rounded to the dtype like a torch add.

        ``x`` is consumed: its storage may hold the sum afterwards. ``residual`` is not modified.
        """
        if self.fused and x.shape == residual.shape and self._fusable(x, residual):
            return fused_triton.add_rms_norm(x, residual, self.weight, self.eps)
        if (
            self.weight.dtype == x.dtype == residual.dtype
            and x.shape == residual.shape
            and kernels.usable(x)
        ):
            return kernels.add_rms_norm(x, residual, self.weight, self.eps), x
        total = x + residual
        return self.reference(total), total

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The torch computation (Hugging Face's LlamaRMSNorm)."""
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)
