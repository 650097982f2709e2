"""What one rank holds on its device, counted by the engine itself, and the peak of it.

Policies and the launcher record each device allocation they make as it happens (a gear's
weights while it is built, a policy's buffers, the KV cache) under an owner's name, by the bytes
of the tensors' storages. On a GPU torch's allocator sees the same memory (plus kernels'
workspaces); on CPU, where "device" memory is host memory, this is the only count, and it is
what a test holds a policy's start-up peak to (Seesaw: one gear's shard plus the KV cache).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch


def storage_bytes(tensors: Iterable[torch.Tensor], device: torch.device) -> int:
    """Bytes of the distinct storages under ``tensors`` that live on ``device``."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t.device != device:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


@dataclass
class DeviceLedger:
    """Device bytes by owner, and the largest total they ever reached."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    held: dict[str, int] = field(default_factory=dict)
    peak: int = 0
    events: list[tuple[str, int]] = field(default_factory=list)  # (what happened, total after)

    @property
    def total(self) -> int:
        return sum(self.held.values())

    def hold(self, owner: str, tensors: Iterable[torch.Tensor]) -> int:
        """``owner`` now holds ``tensors`` (instead of what it held before); their bytes."""
        nbytes = storage_bytes(tensors, self.device)
        self.held[owner] = nbytes
        self._note(f"{owner} holds {nbytes}")
        return nbytes

    def release(self, owner: str) -> None:
        self.held.pop(owner, None)
        self._note(f"{owner} released")

    def _note(self, what: str) -> None:
        total = self.total
        self.peak = max(self.peak, total)
        self.events.append((what, total))
