"""Weight sources: lazy, sliceable views of checkpoint tensors.

A parallel rank narrows a ``LazyWeight`` to its shard before anything is read, so each rank reads
only its slice: safetensors through ``get_slice``, GGUF through row slices of the memory map and
block-aligned byte slices of quantised rows.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gearshift.worker.errors import ModelLoadError

Bounds = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class LazyWeight:
    """A view of one checkpoint tensor; ``load`` reads just the narrowed region."""

    name: str
    full_shape: tuple[int, ...]
    bounds: Bounds
    reader: Callable[[Bounds], torch.Tensor]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(stop - start for start, stop in self.bounds)

    def narrow(self, dim: int, start: int, length: int) -> LazyWeight:
        lo, hi = self.bounds[dim]
        if start < 0 or length < 0 or lo + start + length > hi:
            raise ModelLoadError(
                f"{self.name}: slice [{start}:{start + length}] of dim {dim} exceeds {self.shape}"
            )
        bounds = list(self.bounds)
        bounds[dim] = (lo + start, lo + start + length)
        return replace(self, bounds=tuple(bounds))

    def chunk(self, dim: int, parts: int, index: int) -> LazyWeight:
        """The ``index``-th of ``parts`` equal slices along ``dim``."""
        size = self.shape[dim]
        if size % parts:
            raise ModelLoadError(f"{self.name}: dim {dim} of size {size} not divisible by {parts}")
        step = size // parts
        return self.narrow(dim, index * step, step)

    def load(self) -> torch.Tensor:
        return self.reader(self.bounds)


def _full_bounds(shape: tuple[int, ...]) -> Bounds:
    return tuple((0, n) for n in shape)


class WeightSource(ABC):
    """Checkpoint tensors by Hugging Face parameter name."""

    @abstractmethod
    def names(self) -> list[str]: ...

    @abstractmethod
    def get(self, name: str) -> LazyWeight: ...

    def close(self) -> None:  # noqa: B027 - closing is optional; most sources hold no handle
        """Release file handles (memory maps stay valid until tensors are dropped)."""


class SafetensorsSource(WeightSource):
    """A folder with ``model.safetensors``, or shards plus ``model.safetensors.index.json``."""

    def __init__(self, folder: str | Path) -> None:
        from safetensors import safe_open

        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
            weight_map = {}
        if not files:
            raise ModelLoadError(f"no *.safetensors files in model folder {self.folder}")
        self._handles: dict[str, Any] = {}
        self._where: dict[str, str] = {}
        for fname in files:
            path = self.folder / fname
            if not path.is_file():
                raise ModelLoadError(
                    f"shard {fname} listed in the index is missing in {self.folder}"
                )
            handle = safe_open(str(path), framework="pt")
            self._handles[fname] = handle
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                self._where[key] = fname

    def names(self) -> list[str]:
        return list(self._where)

    def get(self, name: str) -> LazyWeight:
        handle = self._handles[self._where[name]]
        tensor_slice = handle.get_slice(name)
        shape = tuple(int(n) for n in tensor_slice.get_shape())

        def read(bounds: Bounds) -> torch.Tensor:
            if not bounds:
                return tensor_slice[...]
            return tensor_slice[tuple(slice(a, b) for a, b in bounds)]

        return LazyWeight(name, shape, _full_bounds(shape), read)

    def close(self) -> None:
        self._handles.clear()


# GGUF tensor names → Hugging Face names (llama.cpp's naming for llama-family blocks).
_GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors llama.cpp stores that the decoder recomputes itself.
_GGUF_IGNORED = {"rope_freqs.weight"}


def gguf_to_hf_name(name: str) -> str | None:
    """Map a GGUF tensor name to the Hugging Face name, or None for tensors we do not use."""
    if name in _GGUF_IGNORED:
        return None
    stem, _, suffix = name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        if part not in _GGUF_BLOCK_NAMES:
            return None
        return f"model.layers.{layer}.{_GGUF_BLOCK_NAMES[part]}.{suffix}"
    top = _GGUF_TOP_NAMES.get(stem)
    return f"{top}.{suffix}" if top else None


@dataclass(frozen=True)
class GGUFTensor:
    """A tensor of a GGUF file as ``gguf``'s reader presents it: ``shape`` in GGUF order
    (innermost first) and ``data`` a read-only memory-mapped view, shaped [rows..., elements]
    for float types and [rows..., bytes per row] for quantised ones."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray
    data: np.ndarray


def read_gguf_tensors(path: Path) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """Metadata and tensors of a GGUF file. ``gguf.GGUFReader`` builds a numpy view per element
    of every metadata array (seconds for a 49k-token vocabulary, on every rank at every start);
    this walks the header with ``struct`` and maps each tensor's bytes once."""
    import gguf

    from gearshift.worker.tokenizer.errors import TokenizerLoadError
    from gearshift.worker.tokenizer.gguf_metadata import read_gguf_header

    try:
        header = read_gguf_header(path)
    except TokenizerLoadError as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc
    whole = np.memmap(path, dtype=np.uint8, mode="r")
    floats = {
        gguf.GGMLQuantizationType.F32: np.float32,
        gguf.GGMLQuantizationType.F16: np.float16,
    }
    tensors = []
    for info in header.tensors:
        qtype = gguf.GGMLQuantizationType(info.type_id)
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        count = int(np.prod(info.dims))
        nbytes = count * type_size // block
        start = header.data_start + info.offset
        raw = whole[start : start + nbytes]
        if len(raw) != nbytes:
            raise ModelLoadError(f"GGUF file {path}: tensor {info.name} runs past the end")
        dims = tuple(reversed(info.dims))
        if qtype in floats:
            data = raw.view(floats[qtype]).reshape(dims)
        else:
            data = raw.reshape((*dims[:-1], dims[-1] // block * type_size))
        tensors.append(GGUFTensor(info.name, qtype, np.array(info.dims, dtype=np.uint64), data))
    return dict(header.metadata), tensors


class GGUFSource(WeightSource):
    """A single GGUF file; quantised tensors are dequantised to fp32 slice by slice."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.fields, tensors = read_gguf_tensors(self.path)
        self.arch = str(self.fields.get("general.architecture", ""))
        self._all = tensors
        self._tensors: dict[str, Any] = {}
        for tensor in tensors:
            hf = gguf_to_hf_name(tensor.name)
            if hf is not None:
                self._tensors[hf] = tensor

    def tensor_names(self) -> set[str]:
        return {t.name for t in self._all}

    def names(self) -> list[str]:
        return list(self._tensors)

    def get(self, name: str) -> LazyWeight:
        tensor = self._tensors[name]
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        heads = self._permuted_heads(name)
        return LazyWeight(name, shape, _full_bounds(shape), _GGUFReaderFn(tensor, shape, heads))

    def _permuted_heads(self, name: str) -> int | None:
        # llama.cpp's converter interleaves the rotary halves of q/k rows for llama-arch models
        # (its rope pairs adjacent dims); Hugging Face pairs dim i with i + d/2. Undo it per head.
        if self.arch != "llama":
            return None
        if ".self_attn.q_proj." in name:
            return int(self.fields["llama.attention.head_count"])
        if ".self_attn.k_proj." in name:
            heads = self.fields["llama.attention.head_count"]
            return int(self.fields.get("llama.attention.head_count_kv", heads))
        return None


@dataclass(frozen=True)
class _GGUFReaderFn:
    tensor: Any
    shape: tuple[int, ...]
    permuted_heads: int | None

    def __call__(self, bounds: Bounds) -> torch.Tensor:
        import gguf

        from gearshift.worker.model import gguf_dequant  # imports gguf too: only for GGUF files

        data = self.tensor.data
        qtype = self.tensor.tensor_type
        (r0, r1) = bounds[0]
        head_rows = 0
        if self.permuted_heads is not None:
            head_rows = self.shape[0] // self.permuted_heads
            if r0 % head_rows or r1 % head_rows:
                raise ModelLoadError(f"{self.tensor.name}: row slice must be head-aligned")
        rows = data[r0:r1]
        cols: tuple[int, int] | None = bounds[1] if len(bounds) > 1 else None
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            out = np.array(rows if cols is None else rows[:, cols[0] : cols[1]], dtype=np.float32)
        else:
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            if cols is not None and cols[0] % block == 0 and cols[1] % block == 0:
                rows = rows[:, cols[0] // block * type_size : cols[1] // block * type_size]
                cols = None
            if gguf_dequant.supported(qtype):
                out = gguf_dequant.dequantize(rows, qtype).numpy()
            else:
                out = gguf.quants.dequantize(np.ascontiguousarray(rows), qtype).astype(np.float32)
            out = out.reshape(r1 - r0, -1) if len(self.shape) > 1 else out.reshape(-1)
            if cols is not None:
                out = out[:, cols[0] : cols[1]]
        result = torch.from_numpy(np.ascontiguousarray(out))
        if head_rows:
            # llama.cpp wrote GGUF row h*d + 2i + j from HF row h*d + j*(d/2) + i; invert that.
            n = (r1 - r0) // head_rows
            rest = result.shape[1:]
            result = result.reshape(n, head_rows // 2, 2, *rest).transpose(1, 2).reshape(-1, *rest)
        return result.contiguous()


def open_weight_source(path: str | Path) -> WeightSource:
    """A GGUF file or a safetensors folder."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return GGUFSource(p)
    if p.is_dir():
        return SafetensorsSource(p)
    raise ModelLoadError(f"model path {p} is neither a .gguf file nor a model folder")


def iter_weights(source: WeightSource) -> Iterator[tuple[str, LazyWeight]]:
    for name in source.names():
        yield name, source.get(name)
