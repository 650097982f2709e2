"""Kernels wrapped for the current mode: Triton's compiler, or its interpreter on CPU tensors.

Triton reads ``TRITON_INTERPRET`` when ``triton.jit`` wraps a function, so the kernel modules keep
their kernels as plain functions and wrap them here, once per function and mode. Triton's own
library functions (``tl.max``, ``tl.sum``, ``tl.cdiv``) are wrapped when triton is imported, so
the interpreter needs the variable set before that; ``kernel`` says so instead of failing inside.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton

from gearshift.worker.attention.triton.mode import interpreting

# Process-wide on purpose: a wrapped kernel holds its compiled binaries, which every backend
# instance of the process (one per gear) and every layer share.
_WRAPPED: dict[tuple[Callable[..., Any], bool], Any] = {}


def kernel(fn: Callable[..., Any]) -> Any:
    """``fn`` under ``triton.jit`` in the current mode (launch as ``kernel(fn)[grid](...)``)."""
    key = (fn, interpreting())
    wrapped = _WRAPPED.get(key)
    if wrapped is None:
        if key[1] and not library_interpreted():
            raise RuntimeError(
                "TRITON_INTERPRET=1 was set after triton was imported: triton wraps its own "
                "library (tl.max, tl.sum, ...) at import, so set it before the process imports "
                "triton (in the environment the process starts with)"
            )
        wrapped = _WRAPPED[key] = triton.jit(fn)
    return wrapped


def library_interpreted() -> bool:
    """Whether triton.language's own jit functions were wrapped for the interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(getattr(triton.language.standard, "max", None), InterpretedFunction)


def unit_last(x: torch.Tensor) -> torch.Tensor:
    """``x`` with a contiguous last dimension (the kernels index it with unit stride)."""
    return x if x.stride(-1) == 1 else x.contiguous()
