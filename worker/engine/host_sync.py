"""Catch a host synchronisation on the CPU: a read of a tensor's values back to Python.

On a GPU such a read (``.item()``, ``.tolist()``, ``bool(t)``, ``.cpu()``, a boolean-mask index,
``nonzero``) makes the host wait until the device has run everything queued before it, and inside
a CUDA graph capture it is an error. On the CPU it costs nothing, so nothing shows it.
``NoHostSync`` is a torch function mode that raises ``HostSyncError`` at the first such read on
the thread that entered it; the graph runner's CPU stand-in for capture runs every "replay" under
it, so a decode step that could not be captured fails on the CPU first. Modes are per thread:
other threads (a policy's copy threads) are not watched. Reads inside C++ ops (a kernel that
looks at its inputs' values on the host) are beyond its reach.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


class HostSyncError(RuntimeError):
    """A device value was read on the host where the step must not wait for the device."""


# Reads of a tensor's values: each one waits for the device (or cannot be captured).
_READS: frozenset[Callable[..., Any]] = frozenset(
    {
        torch.Tensor.item,
        torch.Tensor.tolist,
        torch.Tensor.__bool__,
        torch.Tensor.__int__,
        torch.Tensor.__float__,
        torch.Tensor.__index__,
        torch.Tensor.numpy,
        torch.Tensor.cpu,
        torch.Tensor.nonzero,
        torch.nonzero,
        torch.Tensor.masked_select,
        torch.masked_select,
        torch.Tensor.unique,
        torch.unique,
        torch.Tensor.repeat_interleave,
        torch.repeat_interleave,
    }
)
_INDEXING = frozenset({torch.Tensor.__getitem__, torch.Tensor.__setitem__})


def _bool_index(index: Any) -> bool:
    """Whether an index holds a boolean mask (its result size depends on the mask's values)."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


class NoHostSync(TorchFunctionMode):
    """Raise ``HostSyncError`` naming the call at the first read of a tensor's values."""

    def __init__(self, what: str = "this step") -> None:
        super().__init__()
        self.what = what

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", repr(func))
        if func in _READS and not (func is torch.Tensor.repeat_interleave and _sized(kwargs)):
            raise HostSyncError(f"{self.what} reads a device value on the host ({name})")
        if func in _INDEXING and len(args) > 1 and _bool_index(args[1]):
            raise HostSyncError(f"{self.what} indexes with a boolean mask ({name})")
        if func is torch.Tensor.to and _to_host(args, kwargs):
            raise HostSyncError(f"{self.what} copies a tensor to the host (to)")
        return func(*args, **kwargs)


def _sized(kwargs: dict[str, Any]) -> bool:
    # repeat_interleave with output_size given needs no read of the repeats.
    return kwargs.get("output_size") is not None


def _to_host(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    # A copy from a device to the host. ``.to(x.device)`` (collectives put their result back
    # where the input lives) moves nothing and is no wait on any device.
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    tensor = args[0] if args else None
    return (
        isinstance(target, (str, torch.device))
        and torch.device(target).type == "cpu"
        and isinstance(tensor, torch.Tensor)
        and not tensor.is_cpu
    )
