"""The FFN of a SiDP layer: computed with the owner's weights, wherever they are (SiDP §4.1–§4.3).

Every decoder layer's ``mlp`` is a ``SidpFFN`` (the model's ``mlp_factory`` hook). An owned layer
declares the checkpoint's gate/up/down parameters, backed by its shared-memory segment, so the
loader writes them straight there; a remote layer declares none and holds no copy. Each call goes
to the rank's ``FfnService``, which runs it in the step's mode: WaS from a cache slot, or CaS at
the owner.

With ``tp`` ranks per replica every rank holds (and fetches) only its TP shard, Megatron-style:
gate/up split by output rows, down by input columns. A shard's FFN gives a partial sum that the
replica's TP group all-reduces, as the plain model's row-parallel down projection does; down's
bias is added once, by TP rank 0, before that reduction.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from gearshift.worker.comm import CommGroup
from gearshift.worker.model.layers.activation import silu_and_mul
from gearshift.worker.model.llama import FfnTensors
from gearshift.worker.model.weights import LazyWeight
from gearshift.worker.policies.sidp.housekeeper import Housekeeper
from gearshift.worker.policies.sidp.shared_weights import FfnWeights


class Mode(enum.IntEnum):
    """How non-owners reach a remote layer in one step (numbers of SidpPolicy.Mode)."""

    WAS = 2
    CAS = 3


def run_ffn(x: torch.Tensor, w: FfnWeights, down_bias: bool = True) -> torch.Tensor:
    """SwiGLU: down(silu(gate(x)) * up(x)); a TP shard's partial sum when ``w`` is a shard
    (``down_bias``: whether this shard adds down's bias, TP rank 0's job)."""
    act = silu_and_mul(F.linear(x, w.gate_up, w.gate_up_bias))
    return F.linear(act, w.down, w.down_bias if down_bias else None)


@dataclass(frozen=True)
class TpShard:
    """Which TP shard of a checkpoint matrix a rank loads: ``dim`` is the split dimension
    (0: output rows, gate/up; 1: input columns, down); the bias is split only along rows."""

    size: int = 1
    rank: int = 0
    dim: int = 0

    def weight(self, w: LazyWeight) -> LazyWeight:
        return w if self.size == 1 else w.chunk(self.dim, self.size, self.rank)

    def bias(self, w: LazyWeight) -> LazyWeight:
        return self.weight(w) if self.dim == 0 else w


class _Matrix(nn.Module):
    """A checkpoint matrix (and bias) whose storage is given: the owner's shared segment."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        rows: list[int],
        shard: TpShard,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.rows = rows  # this rank's row counts of the matrices stacked in ``weight`` (gate, up)
        self.shard = shard

    def _dst(self, name: str) -> torch.Tensor:
        dst = self.weight if name == "weight" else self.bias
        assert dst is not None
        return dst

    def _copy(self, dst: torch.Tensor, w: LazyWeight) -> None:
        from gearshift.worker.errors import ModelLoadError

        if tuple(dst.shape) != w.shape:
            raise ModelLoadError(f"{w.name}: checkpoint {w.shape} != parameter {tuple(dst.shape)}")
        dst.copy_(w.load())

    def _part(self, name: str, w: LazyWeight) -> LazyWeight:
        return self.shard.weight(w) if name == "weight" else self.shard.bias(w)

    def load_weight(self, name: str, w: LazyWeight) -> None:
        self._copy(self._dst(name), self._part(name, w))

    def load_shard(self, name: str, index: int, w: LazyWeight) -> None:
        start = sum(self.rows[:index])
        self._copy(self._dst(name).narrow(0, start, self.rows[index]), self._part(name, w))


class CasRunner(Protocol):
    """Compute-as-a-Service for one layer (cas.py): every rank calls it in layer order."""

    def run(self, layer: int, x: torch.Tensor, owned: FfnWeights | None) -> torch.Tensor: ...

    def settle(self) -> None:
        """Wait for the messages a step left posted."""
        ...


@dataclass
class FfnService:
    """One rank's way to a layer's FFN in the current step's mode."""

    owned: dict[int, FfnWeights]
    housekeeper: Housekeeper  # fills WaS's slots (or its DevicePrefetch: policy.prefetcher)
    cas: CasRunner | None = None
    mode: Mode = Mode.WAS
    tp: CommGroup = field(default_factory=CommGroup.single)  # this replica's TP ranks
    fused_layers: int = 0  # layer calls that ran inside the fused decode op (WaS, tp 1)

    def set_mode(self, mode: Mode) -> bool:
        """Run ``mode`` from the next step on; True if it changed."""
        if mode == self.mode:
            return False
        self.mode = mode
        if mode == Mode.WAS:
            if self.cas is not None:
                self.cas.settle()  # an owner's last answers of the CaS steps
            # The CaS steps in between consumed no slots: restart the prefetch window.
            self.housekeeper.reset()
        else:
            self.housekeeper.close()  # CaS fetches no weights
        return True

    def lend(self, layer: int) -> FfnWeights:
        """WaS: ``layer``'s weights for the fused decode op (owned, or its slot once filled);
        ``give_back`` once the layer ran. One TP rank (the op runs no collective)."""
        assert self.mode == Mode.WAS and self.tp.size == 1
        self.fused_layers += 1
        self.housekeeper.begin_layer(layer)
        mine = self.owned.get(layer)
        return mine if mine is not None else self.housekeeper.acquire(layer)

    def give_back(self, layer: int) -> None:
        if layer not in self.owned:
            self.housekeeper.release(layer)

    def run(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        # Each TP rank computes its shard's partial sum; the replica's TP group adds them up.
        return self.tp.all_reduce(self._partial(layer, x))

    def _partial(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        if self.mode == Mode.CAS:
            assert self.cas is not None
            return self.cas.run(layer, x, self.owned.get(layer))
        hk = self.housekeeper
        hk.begin_layer(layer)
        bias = self.tp.rank == 0
        mine = self.owned.get(layer)
        if mine is not None:
            return run_ffn(x, mine, bias)
        weights = hk.acquire(layer)
        try:
            return run_ffn(x, weights, bias)
        finally:
            hk.release(layer)


class SidpFFN(nn.Module):
    """Layer ``layer``'s FFN slot in the model; owned layers carry the shared-memory weights.

    In WaS a decode step runs it inside the fused decode op (``llama.LendsFfn``): the op gets the
    owned weights or the layer's slot, so SiDP and a plain replica run the same kernels."""

    def __init__(self, layer: int, service: FfnService, owned: FfnWeights | None) -> None:
        super().__init__()
        self.layer = layer
        self.service = service
        if owned is not None:
            inter = owned.down.shape[1]  # this TP rank's share
            tp = service.tp
            self.gate_up_proj = _Matrix(
                owned.gate_up, owned.gate_up_bias, [inter, inter], TpShard(tp.size, tp.rank, 0)
            )
            self.down_proj = _Matrix(
                owned.down, owned.down_bias, [owned.down.shape[0]], TpShard(tp.size, tp.rank, 1)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.service.run(self.layer, x)

    def fusable(self) -> bool:
        # CaS exchanges rows between attention and the FFN, which the one-op layer cannot.
        return self.service.mode == Mode.WAS

    def lend(self) -> FfnTensors:
        w = self.service.lend(self.layer)
        return (w.gate_up, w.gate_up_bias, w.down, w.down_bias)

    def give_back(self) -> None:
        self.service.give_back(self.layer)
