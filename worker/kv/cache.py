"""Paged KV cache tensors: per layer, keys and values of shape [blocks, kv_heads, block_size, D].

Head-major blocks (DESIGN.md) keep each head's slice of a block contiguous, so head-sharded copies
(Shift's gears, Seesaw's host tier) move whole contiguous runs.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import torch

LayerKV = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of one rank's cache; the block count is decided separately from memory."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim * itemsize

    def blocks_for_bytes(self, nbytes: int) -> int:
        return max(0, nbytes // self.bytes_per_block)

    def blocks_for_device_fraction(
        self, fraction: float, device: torch.device, reserve_bytes: int = 0
    ) -> int:
        """Blocks filling ``fraction`` of the device memory that is free right now (GPU), less
        ``reserve_bytes`` that something allocated later will take (CUDA graphs' pool)."""
        free, _total = torch.cuda.mem_get_info(device)
        return self.blocks_for_bytes(int(free * fraction) - reserve_bytes)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on CPU backed by anonymous memory the kernel zero-fills on first touch.

    Stale cache slots must read as zeros, not garbage (masked attention still multiplies them by
    zero, and 0 x NaN is NaN), but memsetting gigabytes up front costs seconds at start-up.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> list[LayerKV]:
    shape = (num_blocks, spec.num_kv_heads, spec.block_size, spec.head_dim)
    return [
        (zeroed(shape, spec.dtype, device), zeroed(shape, spec.dtype, device))
        for _ in range(spec.num_layers)
    ]
