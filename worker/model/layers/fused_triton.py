"""Fused elementwise kernels in Triton for CUDA: residual add + RMSNorm, RoPE, SiLU x mul.

Each replaces several torch ops (each a kernel launch and a pass over memory) with one pass, and
rounds exactly where the torch code does (the sum to the model dtype before the norm, each RoPE
product before the add, silu before the product), so results match the unfused layers up to the
order of a reduction. Whether they run is measured per model at start-up (``fused_ops.py``).

Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a function, so the kernels are
made on first use in each mode (``_kernels``), not at import: tests set the interpreter and run
these on CPU tensors. Only APIs of both triton 3.6 (the GPU machines' torch 2.11) and the current
wheel.
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace
from typing import Any

import torch


def available() -> bool:
    """Whether triton imports here (it ships with CUDA builds of torch)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _kernels() -> SimpleNamespace:
    """The kernels for the current mode: compiled, or interpreted on CPU tensors."""
    return _kernels_in(_interpreting())


# Process-wide on purpose: the jitted kernels hold their compiled binaries, for every layer.
@functools.cache
def _kernels_in(interpreted: bool) -> SimpleNamespace:
    del interpreted  # the cache key: triton.jit reads the mode from the environment
    import triton
    import triton.language as tl

    @triton.jit
    def add_rms_norm_kernel(  # type: ignore[no-untyped-def]
        x_ptr,
        res_ptr,
        w_ptr,
        out_ptr,
        x_stride,
        res_stride,
        out_stride,
        cols,
        eps,
        HAS_RES: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < cols
        x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(res_ptr + row * res_stride + offs, mask=mask, other=0.0).to(tl.float32)
            # The sum is rounded to the model dtype (a torch add), kept in x's row, then normed.
            total = (x + r).to(x_ptr.dtype.element_ty)
            tl.store(x_ptr + row * x_stride + offs, total, mask=mask)
            x = total.to(tl.float32)
        mean_sq = tl.sum(x * x, axis=0) / cols
        normed = (x * tl.rsqrt(mean_sq + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * out_stride + offs, (w * normed).to(out_ptr.dtype.element_ty),
                 mask=mask)  # fmt: skip

    @triton.jit
    def rotary_kernel(  # type: ignore[no-untyped-def]
        x_ptr,
        cos_ptr,
        sin_ptr,
        out_ptr,
        x_stride_t,
        x_stride_h,
        cs_stride,
        out_stride_t,
        out_stride_h,
        half,
        BLOCK: tl.constexpr,
    ):
        t = tl.program_id(0)
        h = tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        mask = offs < half
        dt = out_ptr.dtype.element_ty
        base = x_ptr + t * x_stride_t + h * x_stride_h
        x1 = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + half + offs, mask=mask, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + t * cs_stride + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t * cs_stride + offs, mask=mask, other=0.0).to(tl.float32)
        # Hugging Face's rotate-half: each product rounded to the dtype, then the sum.
        o1 = (x1 * c).to(dt).to(tl.float32) - (x2 * s).to(dt).to(tl.float32)
        o2 = (x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)
        dst = out_ptr + t * out_stride_t + h * out_stride_h
        tl.store(dst + offs, o1.to(dt), mask=mask)
        tl.store(dst + half + offs, o2.to(dt), mask=mask)

    @triton.jit
    def silu_and_mul_kernel(  # type: ignore[no-untyped-def]
        x_ptr, out_ptr, x_stride, out_stride, inter, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < inter
        dt = out_ptr.dtype.element_ty
        gate = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * x_stride + inter + offs, mask=mask, other=0.0).to(tl.float32)
        act = (gate * tl.sigmoid(gate)).to(dt).to(tl.float32)  # F.silu, rounded to the dtype
        tl.store(out_ptr + row * out_stride + offs, (act * up).to(dt), mask=mask)

    return SimpleNamespace(
        add_rms_norm=add_rms_norm_kernel,
        rotary=rotary_kernel,
        silu_and_mul=silu_and_mul_kernel,
        next_power_of_2=triton.next_power_of_2,
        cdiv=triton.cdiv,
    )


def _warps(block: int) -> int:
    return max(1, min(16, block // 256))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of rows x [T, H] (last stride 1) into a new tensor."""
    return _norm(x, None, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the sum is written into ``x`` (RMSNorm's
    add_forward contract: ``x`` is consumed) and returned as the new residual stream."""
    return _norm(x, residual, weight, eps), x


def _norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    k = _kernels()
    rows, cols = x.shape
    out = torch.empty_like(x)
    block = k.next_power_of_2(cols)
    res: Any = residual if residual is not None else x
    k.add_rms_norm[(rows,)](
        x,
        res,
        weight,
        out,
        x.stride(0),
        res.stride(0),
        out.stride(0),
        cols,
        eps,
        HAS_RES=residual is not None,
        BLOCK=block,
        num_warps=_warps(block),
    )
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of heads x [T, H, D] (any row and head strides, last stride 1) with
    cos/sin [T, 1, D/2] into a new contiguous tensor."""
    k = _kernels()
    tokens, heads, dim = x.shape
    out = torch.empty((tokens, heads, dim), dtype=x.dtype, device=x.device)
    half = dim // 2
    if tokens == 0:
        return out
    k.rotary[(tokens, heads)](
        x,
        cos,
        sin,
        out,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        out.stride(0),
        out.stride(1),
        half,
        BLOCK=k.next_power_of_2(half),
        num_warps=1,
    )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up, last stride 1) → [T, I] = silu(gate) * up."""
    k = _kernels()
    rows, width = x.shape
    inter = width // 2
    out = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block = min(1024, k.next_power_of_2(inter))
    k.silu_and_mul[(rows, k.cdiv(inter, block))](
        x, out, x.stride(0), out.stride(0), inter, BLOCK=block, num_warps=_warps(block)
    )
    return out
