"""Typed entry points to the C++ CPU kernels, and whether they can be used in this process.

``available()`` builds/loads the library on first call (seconds once per machine, then a cached
load); if that fails, or ``GEARSHIFT_CPU_KERNELS=0``, it returns False and callers run their torch
reference code instead. The ops themselves assume ``available()`` was checked.
"""

from __future__ import annotations

import functools
import logging
import os
import time

import torch

from gearshift.worker.kernels.build import KernelBuildError, load_library

log = logging.getLogger(__name__)

ENV_SWITCH = "GEARSHIFT_CPU_KERNELS"


# Process-wide on purpose: a shared library is loaded into a process once, and every layer asks.
@functools.cache
def available() -> bool:
    """Whether the gearshift_cpu ops are loaded (building them on first use)."""
    if os.environ.get(ENV_SWITCH, "1").strip() in ("0", "false", "no", "off"):
        log.info("CPU kernels disabled by %s", ENV_SWITCH)
        return False
    started = time.monotonic()
    try:
        path = load_library()
    except KernelBuildError as e:
        log.warning("CPU kernels unavailable, using the torch reference path: %s", e)
        return False
    log.info("CPU kernels loaded from %s in %.1fs", path, time.monotonic() - started)
    return True


def usable(x: torch.Tensor) -> bool:
    """Whether ``x`` can go through the kernels: a CPU tensor of a supported dtype, ops loaded."""
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and available()
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face RMSNorm of the last dimension."""
    return torch.ops.gearshift_cpu.rms_norm.default(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """x ← x + residual (rounded to the dtype); returns rms_norm of that sum. residual is kept."""
    return torch.ops.gearshift_cpu.add_rms_norm.default(x, residual, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    """vLLM's in-place form: residual ← residual + x, then x ← rms_norm(residual)."""
    torch.ops.gearshift_cpu.fused_add_rms_norm.default(x, residual, weight, eps)


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of heads x [T, H, D] with cos/sin [T, 1, D/2], into a new tensor."""
    return torch.ops.gearshift_cpu.rotary_embedding.default(x, cos, sin)


def rotary_embedding_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In-place ``rotary_embedding`` (x may be a strided view, e.g. the q|k part of QKV)."""
    torch.ops.gearshift_cpu.rotary_embedding_.default(x, cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2I] (gate | up) → [..., I] = silu(gate) * up."""
    return torch.ops.gearshift_cpu.silu_and_mul.default(x)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of [rows, n] (first index of the maximum, NaN counts as largest)."""
    return torch.ops.gearshift_cpu.argmax.default(x)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store k/v [T, Hkv, D] at their slots of the head-major paged cache; slot -1 is skipped."""
    torch.ops.gearshift_cpu.write_kv.default(k, v, k_cache, v_cache, slot_mapping)


def paged_decode_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> None:
    """One new token per sequence: write its k/v at ``slot_mapping``, attend over the cache.

    q/out [B, Hq, D], k/v [B, Hkv, D], block_tables [>=B, W] and seq_lens [>=B] int64 (context
    length including the new token).
    """
    torch.ops.gearshift_cpu.paged_decode_attention.default(
        out, q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, scale
    )


def decode_layer(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    weights: list[torch.Tensor | None],
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    eps: float,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole Llama decoder layer for one new token per sequence: (MLP output, residual stream).

    ``weights`` is the layer's slot list (``LlamaDecoderLayer.fused_decode_weights``). ``hidden``
    is consumed when ``residual`` is given (it then holds their sum, like ``add_rms_norm``).
    """
    out: tuple[torch.Tensor, torch.Tensor] = torch.ops.gearshift_cpu.decode_layer.default(
        hidden,
        residual,
        weights,
        k_cache,
        v_cache,
        slot_mapping,
        block_tables,
        seq_lens,
        cos,
        sin,
        num_heads,
        eps,
        scale,
    )
    return out
