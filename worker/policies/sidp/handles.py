"""SiDP's exchange of segment addresses (§4.2): each rank tells the group where its owned FFN
shards are, as typed messages (``typed_collectives``), and a reader checks every field before it
maps anything.

On CPU an address is a shared-memory segment's name. On a GPU it also carries torch's CUDA IPC
description of the owner's allocation as plain data (the arguments of
``torch.multiprocessing.reductions.rebuild_cuda_tensor``); the reader calls that function itself
(``shared_weights.DeviceSegment.attach``). Before, the exchange pickled ``reduce_tensor``'s
(rebuild function, arguments) and called whatever function arrived: any peer could run code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from gearshift.worker.errors import GroupFailure
from gearshift.worker.typed_collectives import all_gather_message
from gearshift.worker.wire import Codec

# The dtypes a model's weights may have; a name not here is refused (never getattr(torch, ...)).
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
MAX_HANDLE_BYTES = 4096  # a CUDA IPC memory or event handle (with torch's prefix) is ~70 bytes
MAX_DEVICES = 1024
_SHM_NAME = re.compile(r"/[A-Za-z0-9_.]{1,250}")  # torch's ref-counter files: /torch_<pid>_...
_SEGMENT = r"gearshift-sidp-{key}-\d{{1,10}}-[0-9a-f]{{12}}-l{layer}-t{tp}"


@dataclass(frozen=True)
class CudaIpcTensor:
    """A flat tensor in another process's GPU memory: ``storage._share_cuda_()``'s fields and
    the tensor's offset, as ``reduce_tensor`` gives them (its size and dtype the reader knows)."""

    device: int
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    tensor_offset: int  # elements into the storage
    numel: int
    dtype: str
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


@dataclass(frozen=True)
class SegmentAddress:
    """One owned FFN shard: layer, TP rank, its segment's name and (GPU) its CUDA IPC handle."""

    layer: int
    tp_rank: int
    name: str
    cuda: CudaIpcTensor | None


@dataclass(frozen=True)
class RankSegments:
    """What one rank tells the group: its shards and (GPU) its device index."""

    rank: int
    device: int | None
    segments: list[SegmentAddress]


SEGMENTS: Codec[RankSegments] = Codec([RankSegments])


@dataclass(frozen=True)
class Expect:
    """What a reader accepts from a rank: the shards it owns, of this group, in this form."""

    key: str  # the group key in segment names
    owned: dict[int, list[int]]  # replica -> the layers it owns
    tp: int
    numel: int  # elements of one shard
    dtype: torch.dtype
    on_gpu: bool


def _bad(rank: int, field: str, why: str) -> GroupFailure:
    return GroupFailure(f"sidp handle exchange: rank {rank}'s {field} refused: {why}")


def _int_in(rank: int, field: str, value: int, low: int, high: int) -> None:
    if not low <= value < high:
        raise _bad(rank, field, f"{value} is not in [{low}, {high})")


def _bytes_of(rank: int, field: str, value: bytes, limit: int = MAX_HANDLE_BYTES) -> None:
    if not 0 < len(value) <= limit:
        raise _bad(rank, field, f"{len(value)} bytes (1 to {limit} allowed)")


def check_cuda(rank: int, field: str, ipc: CudaIpcTensor, want: Expect) -> None:
    """Refuse a CUDA IPC description that is not one shard of ``want``'s size and dtype."""
    _int_in(rank, f"{field}.device", ipc.device, 0, MAX_DEVICES)
    _bytes_of(rank, f"{field}.storage_handle", ipc.storage_handle)
    _bytes_of(rank, f"{field}.ref_counter_handle", ipc.ref_counter_handle, 256)
    if not _SHM_NAME.fullmatch(ipc.ref_counter_handle.decode("ascii", "replace")):
        raise _bad(rank, f"{field}.ref_counter_handle", "not a shared-memory file name")
    if ipc.event_handle is not None:
        _bytes_of(rank, f"{field}.event_handle", ipc.event_handle)
    if DTYPES.get(ipc.dtype) is not want.dtype:
        raise _bad(rank, f"{field}.dtype", f"{ipc.dtype!r}, expected {want.dtype}")
    if ipc.numel != want.numel:
        raise _bad(rank, f"{field}.numel", f"{ipc.numel}, expected {want.numel}")
    item = want.dtype.itemsize
    _int_in(rank, f"{field}.storage_size_bytes", ipc.storage_size_bytes, 1, 1 << 48)
    _int_in(rank, f"{field}.storage_offset_bytes", ipc.storage_offset_bytes, 0, 1 << 48)
    _int_in(rank, f"{field}.ref_counter_offset", ipc.ref_counter_offset, 0, 1 << 31)
    end = ipc.storage_size_bytes // item - ipc.numel + 1
    _int_in(rank, f"{field}.tensor_offset", ipc.tensor_offset, 0, max(end, 0))


def check_rank(sender: int, msg: RankSegments, want: Expect) -> None:
    """Refuse ``msg`` unless it is what rank ``sender`` must say: exactly its owned layers for
    its TP rank, named for this group, with (GPU) or without (CPU) a valid CUDA IPC handle."""
    if msg.rank != sender:
        raise _bad(sender, "rank", f"it says it is rank {msg.rank}")
    if want.on_gpu:
        if msg.device is None:
            raise _bad(sender, "device", "missing on a GPU group")
        _int_in(sender, "device", msg.device, 0, MAX_DEVICES)
    elif msg.device is not None:
        raise _bad(sender, "device", "set on a CPU group")
    tp_rank = sender % want.tp
    layers = [s.layer for s in msg.segments]
    owned = want.owned.get(sender // want.tp, [])
    if sorted(layers) != sorted(owned):
        raise _bad(sender, "segments", f"layers {layers}, expected {owned}")
    for i, seg in enumerate(msg.segments):
        field = f"segments[{i}]"
        if seg.tp_rank != tp_rank:
            raise _bad(sender, f"{field}.tp_rank", f"{seg.tp_rank}, expected {tp_rank}")
        pattern = _SEGMENT.format(key=re.escape(want.key), layer=seg.layer, tp=tp_rank)
        if not re.fullmatch(pattern, seg.name):
            raise _bad(sender, f"{field}.name", f"{seg.name[:80]!r} is not this group's segment")
        if want.on_gpu != (seg.cuda is not None):
            raise _bad(sender, f"{field}.cuda", "missing" if want.on_gpu else "set on a CPU group")
        if seg.cuda is not None:
            check_cuda(sender, f"{field}.cuda", seg.cuda, want)
            if seg.cuda.device != msg.device:
                raise _bad(sender, f"{field}.cuda.device", f"{seg.cuda.device}, not {msg.device}")


def exchange(mine: RankSegments, want: Expect, world_size: int) -> list[RankSegments]:
    """Every rank's segments (``mine`` included), each checked against ``want``; GroupFailure
    naming the rank and field of the first refused one."""
    everyone = [mine]
    if world_size > 1:
        everyone = all_gather_message(SEGMENTS, mine, what="sidp segment addresses")
    for sender, msg in enumerate(everyone):
        check_rank(sender, msg, want)
    return everyone
