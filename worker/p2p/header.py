"""The hidden header of a message under the NCCL rules: what the sender sent, checked by the
receive NCCL would hand it to.

NCCL matches the k-th send from rank a to rank b with b's k-th receive from a, whatever either
side meant. So each message first sends a fixed-size header (the pair's sequence number, the
payload's shape and dtype, the sender's rank and label); the receive compares it with what it
expects before it posts the payload's receive. A mismatch names both sides. The payload's receive
must wait for the check: gloo aborts the process when a message is longer than its receive.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

_MAGIC = 0x47535032  # "GSP2"
MAX_DIMS = 8
LABEL_BYTES = 64
_FORMAT = f"<IQiBB{MAX_DIMS}q{LABEL_BYTES}s"
HEADER_BYTES = struct.calcsize(_FORMAT)

# Codes on the wire; a dtype not listed cannot be checked and is refused under the rules.
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)


def describe(label: str, shape: tuple[int, ...], dtype: torch.dtype) -> str:
    """``'label' float32[2, 4]``: how messages are named in errors."""
    name = str(dtype).removeprefix("torch.")
    return f"'{label}' {name}[{', '.join(str(d) for d in shape)}]"


@dataclass(frozen=True)
class Header:
    """One message as its sender posted it."""

    seq: int  # this message's number among the sender's messages to this receiver (from 0)
    sender: int  # the sender's global rank
    shape: tuple[int, ...]
    dtype: torch.dtype
    label: str

    @staticmethod
    def of(seq: int, sender: int, tensor: torch.Tensor, label: str) -> Header:
        return Header(seq, sender, tuple(tensor.shape), tensor.dtype, label)

    def encode(self) -> torch.Tensor:
        if len(self.shape) > MAX_DIMS:
            raise ValueError(f"{self.described}: more than {MAX_DIMS} dimensions")
        if self.dtype not in DTYPES:
            raise ValueError(f"{self.described}: no header code for {self.dtype}")
        dims = list(self.shape) + [0] * (MAX_DIMS - len(self.shape))
        raw = struct.pack(
            _FORMAT,
            _MAGIC,
            self.seq,
            self.sender,
            DTYPES.index(self.dtype),
            len(self.shape),
            *dims,
            self.label.encode()[:LABEL_BYTES],
        )
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    @staticmethod
    def decode(buf: torch.Tensor) -> Header:
        magic, seq, sender, code, ndim, *rest = struct.unpack(_FORMAT, buf.numpy().tobytes())
        dims, label = rest[:MAX_DIMS], rest[MAX_DIMS]
        if magic != _MAGIC or code >= len(DTYPES) or ndim > MAX_DIMS:
            raise ValueError("not a gearshift p2p header (a message posted outside the module?)")
        text = label.rstrip(b"\0").decode(errors="replace")
        return Header(seq, sender, tuple(dims[:ndim]), DTYPES[code], text)

    @property
    def described(self) -> str:
        return describe(self.label, self.shape, self.dtype)

    def mismatch(
        self, receiver: int, seq: int, shape: tuple[int, ...], dtype: torch.dtype, label: str
    ) -> str | None:
        """Why rank ``receiver``'s receive #``seq`` from this sender, expecting ``label`` of
        ``shape`` and ``dtype``, must not take this message (None: it may)."""
        wanted = label.encode()[:LABEL_BYTES].decode(errors="replace")
        if (self.seq, self.shape, self.dtype, self.label) == (seq, shape, dtype, wanted):
            return None
        return (
            f"rank {self.sender} sent {self.described} as its message #{self.seq} to rank "
            f"{receiver}, whose receive #{seq} from rank {self.sender} expects "
            f"{describe(label, shape, dtype)}: NCCL would hand the one to the other"
        )
