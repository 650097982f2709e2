"""Read the key/value metadata of a GGUF file without touching its tensors.

`gguf.GGUFReader` builds a numpy view per array element and parses every tensor header, which
costs seconds on a 49k-token vocabulary; the tokenizer needs only the metadata block at the head
of the file, so this walks it directly with `struct` over a memory map.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from gearshift.worker.tokenizer.errors import TokenizerLoadError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)

MetadataValue = str | int | float | bool | list["MetadataValue"]

# GGUF value type id -> struct format of one scalar (little-endian); 8 = string, 9 = array.
_SCALAR_FORMATS: dict[int, str] = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING = 8
_ARRAY = 9


class _Cursor:
    """A read position over the mapped file; every read is bounds-checked by `struct`."""

    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer = buffer
        self.offset = 0

    def scalar(self, fmt: str) -> int | float | bool:
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = int(self.scalar("Q"))
        raw = self.buffer[self.offset : self.offset + length]
        if len(raw) != length:
            raise struct.error("string runs past the end of the file")
        self.offset += length
        # Vocabularies hold byte tokens that are not valid UTF-8 on their own.
        return raw.decode("utf-8", errors="replace")

    def value(self, type_id: int) -> MetadataValue:
        if type_id == _STRING:
            return self.string()
        if type_id == _ARRAY:
            item_type = int(self.scalar("I"))
            count = int(self.scalar("Q"))
            fmt = _SCALAR_FORMATS.get(item_type)
            if fmt is not None:
                # One unpack for a whole numeric array (token types, scores) keeps this fast.
                values = struct.unpack_from(f"<{count}{fmt}", self.buffer, self.offset)
                self.offset += struct.calcsize(fmt) * count
                return list(values)
            return [self.value(item_type) for _ in range(count)]
        fmt = _SCALAR_FORMATS.get(type_id)
        if fmt is None:
            raise struct.error(f"unknown GGUF value type {type_id}")
        return self.scalar(fmt)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's header: ``dims`` innermost first (GGUF order), ``offset`` from the data
    section's start."""

    name: str
    dims: tuple[int, ...]
    type_id: int
    offset: int


@dataclass(frozen=True)
class GGUFHeader:
    metadata: dict[str, MetadataValue]
    tensors: list[TensorInfo]
    data_start: int  # file offset of the (aligned) tensor data section


def read_gguf_metadata(path: str | Path) -> dict[str, MetadataValue]:
    """All metadata key/value pairs of a GGUF file (v2 or v3, little-endian)."""
    return read_gguf_header(path, tensors=False).metadata


def read_gguf_header(path: str | Path, tensors: bool = True) -> GGUFHeader:
    """The metadata and (``tensors``) the tensor headers of a GGUF file; no tensor data is read."""
    path = Path(path)
    try:
        with (
            path.open("rb") as handle,
            mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mm,
        ):
            if mm[:4] != GGUF_MAGIC:
                raise TokenizerLoadError(path, "not a GGUF file (bad magic)")
            cursor = _Cursor(mm)
            cursor.offset = 4
            version = int(cursor.scalar("I"))
            if version not in SUPPORTED_VERSIONS:
                raise TokenizerLoadError(path, f"unsupported GGUF version {version}")
            tensor_count = int(cursor.scalar("Q"))
            kv_count = int(cursor.scalar("Q"))
            metadata: dict[str, MetadataValue] = {}
            for _ in range(kv_count):
                key = cursor.string()
                metadata[key] = cursor.value(int(cursor.scalar("I")))
            infos: list[TensorInfo] = []
            if not tensors:
                return GGUFHeader(metadata, infos, 0)
            for _ in range(tensor_count):
                name = cursor.string()
                n_dims = int(cursor.scalar("I"))
                dims = struct.unpack_from(f"<{n_dims}Q", mm, cursor.offset)
                cursor.offset += 8 * n_dims
                type_id = int(cursor.scalar("I"))
                infos.append(TensorInfo(name, tuple(dims), type_id, int(cursor.scalar("Q"))))
            alignment = int(metadata.get("general.alignment", 32))  # type: ignore[arg-type]
            start = -(-cursor.offset // alignment) * alignment
            return GGUFHeader(metadata, infos, start)
    except (OSError, ValueError, struct.error) as exc:
        raise TokenizerLoadError(path, f"cannot read GGUF metadata: {exc}") from exc
