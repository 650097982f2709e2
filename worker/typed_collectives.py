"""Typed messages over torch.distributed: every rank's message gathered, or one rank's message
broadcast, as the wire codec's JSON (``wire.py``) in uint8 tensors.

Never the ``*_object`` collectives: they pickle what a rank sends and unpickle it on the others,
so a peer (or anyone who reached the group's sockets) could run code on every rank. Here a rank
receives bytes, and decoding builds only the codec's dataclasses; a length out of bounds or bytes
that are not a message are a GroupFailure naming the sender. Every rank sees the same lengths,
so a refused length fails every rank at the same point instead of leaving some in a collective.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.distributed as dist

from gearshift.worker.errors import GroupFailure
from gearshift.worker.wire import Codec, WireError

M = TypeVar("M")
MAX_MESSAGE_BYTES = 1 << 20  # a group's setup messages are a few KiB


def _device(group: Any) -> torch.device:
    # NCCL moves device tensors only; gloo host tensors.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_length(n: int, who: str, what: str, limit: int) -> None:
    if not 0 < n <= limit:
        raise GroupFailure(f"{what}: {who} announced {n} bytes (1 to {limit} allowed)")


def _to_bytes(t: torch.Tensor, n: int) -> bytes:
    return t[:n].cpu().numpy().tobytes()


def all_gather_bytes(
    data: bytes, group: Any = None, what: str = "message", limit: int = MAX_MESSAGE_BYTES
) -> list[bytes]:
    """Every rank's ``data`` of ``group`` (None: the default group), in group-rank order."""
    _check_length(len(data), "this rank", what, limit)
    device = _device(group)
    size = dist.get_world_size(group)
    mine = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(mine) for _ in range(size)]
    dist.all_gather(lengths, mine, group=group)
    sizes = [int(t.item()) for t in lengths]
    for r, n in enumerate(sizes):
        _check_length(n, f"group rank {r}", what, limit)
    width = max(sizes)
    buf = torch.zeros(width, dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(device)
    parts = [torch.empty_like(buf) for _ in range(size)]
    dist.all_gather(parts, buf, group=group)
    return [_to_bytes(t, n) for t, n in zip(parts, sizes, strict=True)]


def broadcast_bytes(
    data: bytes | None,
    src: int,
    group: Any = None,
    what: str = "message",
    limit: int = MAX_MESSAGE_BYTES,
) -> bytes:
    """``src``'s ``data`` (a global rank, as ``dist.broadcast`` takes it) on every rank of
    ``group``; the others pass None."""
    device = _device(group)
    is_src = dist.get_rank() == src
    if is_src:
        if data is None:
            raise ValueError("the broadcasting rank must pass its data")
        _check_length(len(data), "this rank", what, limit)
    length = torch.tensor([len(data) if is_src and data is not None else 0], device=device)
    dist.broadcast(length, src, group=group)
    n = int(length.item())
    _check_length(n, f"rank {src}", what, limit)
    buf = torch.zeros(n, dtype=torch.uint8)
    if is_src and data is not None:
        buf[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(device)
    dist.broadcast(buf, src, group=group)
    return _to_bytes(buf, n)


def _decode(codec: Codec[M], data: bytes, who: str, what: str) -> M:
    try:
        return codec.decode(data)
    except WireError as exc:
        raise GroupFailure(f"{what} from {who} refused: {exc}") from None


def all_gather_message(
    codec: Codec[M], message: M, group: Any = None, what: str = "message"
) -> list[M]:
    """Every rank's ``message`` (one of ``codec``'s), in group-rank order; GroupFailure naming
    the rank whose bytes are not a message."""
    parts = all_gather_bytes(codec.encode(message), group, what)
    return [_decode(codec, data, f"group rank {r}", what) for r, data in enumerate(parts)]


def broadcast_message(
    codec: Codec[M], message: M | None, src: int, group: Any = None, what: str = "message"
) -> M:
    """``src``'s ``message`` on every rank (the others pass None); GroupFailure when what
    arrived is not one of ``codec``'s messages."""
    data = None if message is None else codec.encode(message)
    return _decode(codec, broadcast_bytes(data, src, group, what), f"rank {src}", what)
