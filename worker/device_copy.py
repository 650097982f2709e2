"""Host values onto a device without making the host wait for the device.

``torch.tensor(values, device="cuda")`` and ``cpu_tensor.to("cuda")`` copy synchronously: the host
waits until every kernel queued before the copy has run, which in a decode step is the whole
forward pass. A copy from pinned host memory with ``non_blocking=True`` is queued like a kernel
instead (torch's caching host allocator keeps the pinned block alive until the copy has run). On
the CPU, and on devices that cannot be read from the host (``meta``, which tests use to prove that
a path never reads a device value), the plain copy is already free of any wait.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``, queued behind the device's work, never waited for."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def tensor_on(
    values: Sequence[int] | Sequence[float] | Sequence[bool],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` without a host synchronisation."""
    return to_device(torch.tensor(values, dtype=dtype), device)
