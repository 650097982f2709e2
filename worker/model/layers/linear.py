"""Tensor-parallel linear layers; each owns how its weight is sharded (``load_weight``).

Megatron-style: a column-parallel layer splits output features across the TP group, a row-parallel
layer splits input features and all-reduces its partial sums. Fused QKV and gate/up layers are
column-parallel layers made of several logical matrices that load one at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gearshift.worker.comm import CommGroup
from gearshift.worker.errors import ModelLoadError
from gearshift.worker.model.weights import LazyWeight


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Uninitialised on purpose: every value is overwritten by the loader, and a random init of a
    # full model would cost time and a throwaway copy in memory.
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def _copy(dst: torch.Tensor, src: LazyWeight) -> None:
    if tuple(dst.shape) != src.shape:
        raise ModelLoadError(
            f"{src.name}: checkpoint slice {src.shape} != parameter {tuple(dst.shape)}"
        )
    dst.copy_(src.load())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    # oneDNN otherwise re-lays-out the weight on every call, which dominates small-batch (decode)
    # matmuls on CPU: ~1.7x at 32 rows for SmolLM2's MLP (benchmarks/offline_throughput.py).
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 32)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if x.dim() == 2:  # the model's packed token batch: no reshape ops on the hot path
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    out = torch.ops.mkldnn._linear_pointwise(
        x.reshape(-1, x.shape[-1]), packed, bias, "none", [], ""
    )
    return out.view(*x.shape[:-1], out.shape[-1])


def divide(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise ModelLoadError(f"{what} ({n}) is not divisible by the tensor-parallel size {parts}")
    return n // parts


class ReplicatedLinear(nn.Module):
    """A linear layer every rank holds whole."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.weight = _param((out_features, in_features), dtype, device)
        self.bias = _param((out_features,), dtype, device) if bias else None
        self.packed: torch.Tensor | None = None

    def load_weight(self, name: str, w: LazyWeight) -> None:
        _copy(self.weight if name == "weight" else self._bias(), w)

    def _bias(self) -> torch.Tensor:
        assert self.bias is not None
        return self.bias

    def pack_weights(self, packing: str) -> None:
        """Keep a oneDNN-packed copy of the weight when the model's packing is ``onednn``
        (cpu_features.choose_packing decided it for this CPU and dtype)."""
        if packing == "onednn":
            self.packed = pack_weight(self.weight)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ColumnParallelLinear(ReplicatedLinear):
    """Output features split over the TP group; the output stays sharded."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: CommGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.tp = tp
        super().__init__(
            in_features, divide(out_features, tp.size, "output features"), bias, dtype, device
        )

    def load_weight(self, name: str, w: LazyWeight) -> None:
        super().load_weight(name, w.chunk(0, self.tp.size, self.tp.rank))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked (gate and up), each sharded on its own."""

    def __init__(
        self,
        in_features: int,
        out_sizes: list[int],
        bias: bool,
        tp: CommGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.local_sizes = [divide(n, tp.size, "output features") for n in out_sizes]
        super().__init__(in_features, sum(out_sizes), bias, tp, dtype, device)

    def load_shard(self, name: str, index: int, w: LazyWeight) -> None:
        start = sum(self.local_sizes[:index])
        dst = self.weight if name == "weight" else self._bias()
        _copy(dst.narrow(0, start, self.local_sizes[index]), w.chunk(0, self.tp.size, self.tp.rank))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; query heads split over TP, KV heads split or replicated.

    When TP exceeds the number of KV heads each KV head is replicated on ``tp / kv_heads`` ranks,
    so every rank keeps at least one KV head for its query heads (GQA).
    """

    def __init__(
        self,
        hidden: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: CommGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp.size, "attention heads")
        if tp.size >= num_kv_heads:
            divide(tp.size, num_kv_heads, "TP size over KV heads")
            self.num_kv_heads = 1
            self.kv_head_index = tp.rank // (tp.size // num_kv_heads)
        else:
            self.num_kv_heads = divide(num_kv_heads, tp.size, "KV heads")
            self.kv_head_index = tp.rank * self.num_kv_heads
        self.total_kv_heads = num_kv_heads
        self.tp = tp
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        ReplicatedLinear.__init__(self, hidden, out, bias, dtype, device)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def load_shard(self, name: str, which: str, w: LazyWeight) -> None:
        dst = self.weight if name == "weight" else self._bias()
        if which == "q":
            _copy(dst.narrow(0, 0, self.q_size), w.chunk(0, self.tp.size, self.tp.rank))
            return
        offset = self.q_size if which == "k" else self.q_size + self.kv_size
        src = w.narrow(0, self.kv_head_index * self.head_dim, self.kv_size)
        _copy(dst.narrow(0, offset, self.kv_size), src)


class RowParallelLinear(ReplicatedLinear):
    """Input features split over the TP group; partial outputs are all-reduced."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        tp: CommGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.tp = tp
        super().__init__(
            divide(in_features, tp.size, "input features"), out_features, bias, dtype, device
        )

    def load_weight(self, name: str, w: LazyWeight) -> None:
        if name == "weight":
            _copy(self.weight, w.chunk(1, self.tp.size, self.tp.rank))
        else:
            _copy(self._bias(), w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(self.matmul(x, None))
        # The bias is added once, after the reduction.
        return out + self.bias if self.bias is not None else out
