"""Kernels wrapped for the current mode: Triton's compiler, or its interpreter on CPU tensors.

Triton reads ``TRITON_INTERPRET`` when ``triton.jit`` wraps a function, so the kernel modules keep
their kernels as plain functions and wrap them here, once per function and mode: a process (a
test session) that sets the variable after importing them still gets the mode it asks for.
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
        wrapped = _WRAPPED[key] = triton.jit(fn)
    return wrapped


def unit_last(x: torch.Tensor) -> torch.Tensor:
    """``x`` with a contiguous last dimension (the kernels index it with unit stride)."""
    return x if x.stride(-1) == 1 else x.contiguous()
