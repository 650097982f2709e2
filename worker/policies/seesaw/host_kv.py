"""Seesaw's host KV tier (§4.2 tiered KV cache buffering, Fig. 7): one named POSIX shared-memory
segment per worker group, shared by the node's ranks.

The store holds every layer and every KV head of a sequence, so it does not depend on a gear:
a rank of the prefill gear writes its shard (its stage's layers, its heads) and a rank of the
decode gear reads another shard of the same pages. Pages hold ``block_size`` tokens, like the
device's blocks, laid out ``[layers, 2, kv_heads, block_size, head_dim]`` (head-major, §5.2), so
one head's run of a page is contiguous and a head shard is a few contiguous copies.

The segment ends with the swap-in readiness board (``readiness.py``): one int64 slot per rank
and one for the leader, after the pages.

The segment's name is ``gearshift-kv-<group>-<leader pid>-<random>``: never fixed, so two groups
on one node never share it; the leader unlinks it when the group ends, and the next start of
the same group unlinks segments whose leader is no longer alive (a SIGKILLed leader).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from gearshift.worker import shm_segments
from gearshift.worker.errors import GroupFailure
from gearshift.worker.policies.seesaw.readiness import ReadinessBoard, board_bytes
from gearshift.worker.wire import Codec

log = logging.getLogger(__name__)

PREFIX = "gearshift-kv-"
SHM_DIR = shm_segments.SHM_DIR


@dataclass(frozen=True)
class PageShape:
    """One host page: ``block_size`` tokens of every layer and KV head."""

    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


def group_tag(env: dict[str, str] | None = None) -> str:
    """The group's name as the operator sets it ($GEARSHIFT_GROUP_NAME), safe for a file name."""
    return shm_segments.group_key(env)


def segment_name(tag: str) -> str:
    return shm_segments.segment_name(PREFIX, tag)


@dataclass(frozen=True)
class StoreAddress:
    """What rank 0 tells the group's other ranks of the store it created (a typed message,
    ``typed_collectives.broadcast_message``; never a pickle)."""

    name: str
    pages: int


STORE_ADDRESS: Codec[StoreAddress] = Codec([StoreAddress])


def check_address(address: StoreAddress, tag: str) -> None:
    """Refuse an address that is not a segment of this group (a path, another group's)."""
    pattern = rf"{re.escape(PREFIX)}{re.escape(tag)}-\d{{1,10}}-[0-9a-f]{{12}}"
    if not re.fullmatch(pattern, address.name):
        raise GroupFailure(
            f"seesaw host KV store: rank 0's name refused: {address.name[:80]!r} is not a "
            "segment of this group"
        )
    if not 0 < address.pages < 1 << 40:
        raise GroupFailure(f"seesaw host KV store: rank 0's pages refused: {address.pages}")


def clean_stale(tag: str, shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink this group's segments whose leader process is gone; the names removed."""
    return shm_segments.clean_stale(PREFIX, tag, shm_dir)


class HostKVStore:
    """The shared pages of one group, as a tensor [pages, layers, 2, kv_heads, block, D] on every
    rank; page bookkeeping (which sequence holds which page) lives on the leader."""

    def __init__(
        self, name: str, shape: PageShape, num_pages: int, create: bool, world_size: int = 1
    ) -> None:
        self.name = name
        self.shape = shape
        self.num_pages = num_pages
        self.owner = create
        path = SHM_DIR / name
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        if create:
            shm_segments.own(path)
        try:
            board_at = -(-num_pages * shape.nbytes // 64) * 64
            size = board_at + board_bytes(world_size)
            if create:
                os.ftruncate(fd, size)  # sparse: pages cost memory once written
            self._mmap: mmap.mmap | None = mmap.mmap(fd, size)
        except BaseException:
            if create:
                shm_segments.unlink(path)
            raise
        finally:
            os.close(fd)
        whole = torch.frombuffer(self._mmap, dtype=torch.uint8)
        flat = whole[: num_pages * shape.nbytes]
        self.pages = flat.view(shape.dtype).view(
            num_pages, shape.num_layers, 2, shape.num_kv_heads, shape.block_size, shape.head_dim
        )
        tail = whole[board_at:].view(torch.int64)  # board_bytes: swap-out slots, then swap-in
        self.board = ReadinessBoard(tail[world_size:], tail[:world_size])
        self._whole = whole
        self.pinned = False

    @staticmethod
    def create(tag: str, shape: PageShape, num_pages: int, world_size: int = 1) -> HostKVStore:
        clean_stale(tag)
        return HostKVStore(segment_name(tag), shape, num_pages, True, world_size)

    def write_shard(
        self,
        pages: torch.Tensor,
        blocks: torch.Tensor,
        device_kv: list[tuple[torch.Tensor, torch.Tensor]],
        layers: range,
        heads: range,
    ) -> int:
        """Copy device ``blocks`` of this rank's layers/heads into host ``pages``; bytes moved."""
        moved = 0
        h0, h1 = heads.start, heads.stop
        for local, layer in enumerate(layers):
            for kv in (0, 1):
                src = device_kv[local][kv].index_select(0, blocks.to(device_kv[local][kv].device))
                self.pages[pages, layer, kv, h0:h1] = src.to("cpu")
                moved += src.numel() * src.element_size()
        return moved

    def write_part(
        self, pages: torch.Tensor, layer: int, kv: int, heads: range, src: torch.Tensor
    ) -> None:
        """One layer's keys or values of ``pages`` for ``heads`` (the writer thread's unit)."""
        self.pages[pages, layer, kv, heads.start : heads.stop] = src.to("cpu")

    def read_shard(
        self,
        pages: torch.Tensor,
        blocks: torch.Tensor,
        device_kv: list[tuple[torch.Tensor, torch.Tensor]],
        layers: range,
        heads: range,
    ) -> int:
        """Copy host ``pages`` (this rank's layers/heads) into device ``blocks``; bytes moved."""
        moved = 0
        h0, h1 = heads.start, heads.stop
        for local, layer in enumerate(layers):
            for kv in (0, 1):
                dst = device_kv[local][kv]
                src = self.pages[pages, layer, kv, h0:h1]
                dst.index_copy_(0, blocks.to(dst.device), src.to(dst.device, non_blocking=True))
                moved += src.numel() * src.element_size()
        return moved

    def pin(self) -> None:
        """Page-lock this process's mapping for the GPU (cudaHostRegister, §4.2: the host tier
        is pinned memory), so copies between it and the device run asynchronously by DMA.
        Every page of the segment becomes resident now. CUDA only."""
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(self._whole.data_ptr(), self._whole.numel(), 0)
        if int(getattr(err, "value", err)) != 0:
            raise RuntimeError(
                f"cudaHostRegister of the host KV store {self.name} "
                f"({self._whole.numel() / 2**30:.1f} GiB) failed: {err}"
            )
        self.pinned = True

    def close(self) -> None:
        """Unmap; the creator also unlinks the segment (the group is over)."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self._whole.data_ptr())
            self.pinned = False
        self._whole = torch.empty(0, dtype=torch.uint8)
        self.pages = torch.empty(0)
        # In place: the leader's queue holds the board, and a live view would keep the mapping.
        self.board.slots = [0] * len(self.board.slots)
        self.board.out_slots = [0] * len(self.board.out_slots)
        if self._mmap is not None:
            # A tensor view still alive keeps the mapping; it goes with the process then.
            with contextlib.suppress(BufferError):
                self._mmap.close()
            self._mmap = None
        if self.owner:
            shm_segments.unlink(SHM_DIR / self.name)
