"""FFN weights in named POSIX shared memory: the owner writes them once, other ranks of the host
read them one-sided (SiDP §4.2 on CPU; on GPUs the same role falls to CUDA IPC).

One segment per owned layer and TP rank of the owner, named
``gearshift-sidp-<group>-<pid>-<random>-l<layer>-t<tp rank>``: each holds that TP rank's shard, the
one the same TP rank of every other replica reads. The group key keeps two deployments apart, the
random part two starts of one group, and the creator's pid lets the next start unlink segments
whose creator died without cleaning up.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from gearshift.worker import shm_segments
from gearshift.worker.errors import GroupFailure
from gearshift.worker.model.config import ModelConfig
from gearshift.worker.policies.sidp.handles import DTYPES, CudaIpcTensor

PREFIX = "gearshift-sidp-"
SHM_DIR = shm_segments.SHM_DIR


def group_key(text: str) -> str:
    """A segment-name-safe form of a deployment/group identity (address, port, name)."""
    return shm_segments.safe_key(text)


def new_segment_name(key: str, layer: int, tp_rank: int = 0) -> str:
    return shm_segments.segment_name(PREFIX, key, f"-l{layer}-t{tp_rank}")


def clean_stale(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink SiDP segments whose creating process is gone; returns their names."""
    return shm_segments.clean_stale(PREFIX, None, shm_dir)


def segments(
    key: str | None = None, shm_dir: Path = SHM_DIR, pids: Iterable[int] | None = None
) -> list[str]:
    """Names of live SiDP segments (of one group key, or all; created by ``pids``, or anyone)."""
    names = shm_segments.segments(PREFIX, key, shm_dir)
    return names if pids is None else shm_segments.created_by(names, pids)


@dataclass(frozen=True)
class FfnLayout:
    """Where gate|up, down and their biases sit in one TP rank's shard of a layer's FFN (flat):
    ``inter`` is that rank's share of the intermediate size; down's bias is whole."""

    hidden: int
    inter: int
    bias: bool

    @staticmethod
    def of(cfg: ModelConfig, tp: int = 1) -> FfnLayout:
        return FfnLayout(cfg.hidden_size, cfg.intermediate_size // tp, cfg.mlp_bias)

    @property
    def numel(self) -> int:
        h, i = self.hidden, self.inter
        return 3 * h * i + ((2 * i + h) if self.bias else 0)

    def views(self, flat: torch.Tensor) -> FfnWeights:
        h, i = self.hidden, self.inter
        gate_up = flat[: 2 * i * h].view(2 * i, h)
        down = flat[2 * i * h : 3 * i * h].view(h, i)
        gate_up_bias = down_bias = None
        if self.bias:
            gate_up_bias = flat[3 * i * h : 3 * i * h + 2 * i]
            down_bias = flat[3 * i * h + 2 * i : self.numel]
        return FfnWeights(gate_up, gate_up_bias, down, down_bias)


@dataclass(frozen=True)
class FfnWeights:
    """One layer's FFN tensors (views into a segment or a cache slot)."""

    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


class Segment:
    """One mapped segment: created (owner) or attached (a reader)."""

    def __init__(self, name: str, nbytes: int, create: bool) -> None:
        self.name = name
        self.owner = create
        path = SHM_DIR / name
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        if create:
            shm_segments.own(path)
        try:
            if create:
                os.ftruncate(fd, nbytes)
            self._map: mmap.mmap | None = mmap.mmap(fd, nbytes)
        except BaseException:
            if create:
                shm_segments.unlink(path)
            raise
        finally:
            os.close(fd)
        self.nbytes = nbytes

    def tensor(self, dtype: torch.dtype) -> torch.Tensor:
        assert self._map is not None
        return torch.frombuffer(self._map, dtype=dtype)

    def close(self) -> None:
        """Drop the mapping; the owner also unlinks the name (readers keep their mappings)."""
        if self.owner:
            shm_segments.unlink(SHM_DIR / self.name)
        if self._map is not None:
            # A tensor may still view the buffer; the mapping then goes with the last view.
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None


class DeviceSegment:
    """One owned layer's FFN shard in GPU memory, read by the host's other ranks over CUDA IPC
    (SiDP §4.2 on GPUs: a one-sided read of the owner's memory, no collective).

    The owner allocates the flat tensor on its device and publishes ``address()`` (the CUDA IPC
    handle torch's multiprocessing reductions make, as plain data: ``handles.py``) with the
    group's other segment names; a reader ``attach``es it and gets a tensor on the owner's
    memory. The owner keeps the
    allocation until ``close``; torch's IPC reference counts keep it mapped while a reader holds
    a view.
    """

    def __init__(self, name: str, flat: torch.Tensor, owner: bool) -> None:
        self.name = name
        self.owner = owner
        self.nbytes = flat.numel() * flat.element_size()
        self._flat: torch.Tensor | None = flat

    @staticmethod
    def create(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> DeviceSegment:
        return DeviceSegment(name, torch.empty(numel, dtype=dtype, device=device), owner=True)

    def address(self) -> CudaIpcTensor:
        """What a reader needs to map it: torch's CUDA IPC description of the allocation, as
        plain data (``handles.py``), never a callable."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

        assert self._flat is not None
        # reduce_tensor, not storage._share_cuda_() alone: it also records the storage in
        # torch's IPC cache, as sending the tensor to a torch.multiprocessing child would.
        rebuild, args = reduce_tensor(self._flat)
        assert rebuild is rebuild_cuda_tensor, rebuild
        # rebuild_cuda_tensor's parameters, in its order (torch/multiprocessing/reductions.py).
        size, offset, dtype = args[1], args[3], args[5]
        device, handle, nbytes, at = args[6:10]
        counter, counter_at, event, sync = args[11:15]
        return CudaIpcTensor(
            device=int(device),
            storage_handle=bytes(handle),
            storage_size_bytes=int(nbytes),
            storage_offset_bytes=int(at),
            tensor_offset=int(offset),
            numel=int(size[0]),
            dtype=str(dtype).removeprefix("torch."),
            ref_counter_handle=bytes(counter),
            ref_counter_offset=int(counter_at),
            event_handle=None if event is None else bytes(event),
            event_sync_required=bool(sync),
        )

    @staticmethod
    def attach(name: str, ipc: CudaIpcTensor) -> DeviceSegment:
        """Map a peer's shard; ``ipc`` has passed ``handles.check_rank``. The rebuild function
        is torch's, chosen here; only its data arguments come from the peer."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        if ipc.device >= torch.cuda.device_count():
            raise GroupFailure(
                f"sidp segment {name}: device {ipc.device} is not a device of this host "
                f"({torch.cuda.device_count()} GPUs)"
            )
        flat = rebuild_cuda_tensor(
            torch.Tensor,
            torch.Size([ipc.numel]),
            (1,),
            ipc.tensor_offset,
            torch.storage.TypedStorage,
            DTYPES[ipc.dtype],
            ipc.device,
            ipc.storage_handle,
            ipc.storage_size_bytes,
            ipc.storage_offset_bytes,
            False,  # requires_grad
            ipc.ref_counter_handle,
            ipc.ref_counter_offset,
            ipc.event_handle,
            ipc.event_sync_required,
        )
        return DeviceSegment(name, flat, owner=False)

    def tensor(self, dtype: torch.dtype) -> torch.Tensor:
        assert self._flat is not None
        if self._flat.dtype != dtype:
            raise TypeError(f"{self.name} holds {self._flat.dtype}, not {dtype}")
        return self._flat

    def close(self) -> None:
        self._flat = None
