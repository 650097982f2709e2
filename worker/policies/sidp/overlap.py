"""CaS steps as two micro-batches whose exchanges overlap attention (SiDP §4.3: "P2P transfers
are issued by non-owners and can be overlapped with the computation of earlier steps in the
decode iteration").

In one decode iteration the only work that does not depend on layer ℓ's FFN answer is attention
of rows whose answer is already in: so a replica's rows are split in two halves, A and B, and the
layers run interleaved (A ℓ, B ℓ, A ℓ+1, B ℓ+1, …). A's rows of layer ℓ travel to the owner
while B's attention of ℓ runs; B's answer of ℓ travels back while A's attention of ℓ+1 runs. An
owner still receives every replica's halves before its one fused GEMM of the layer (GEMM fusion)
and idle replicas still send nothing (dummy skipping: ``cas.py``). The attention of each half is
that of its own sequences (``AttentionMetadata.split``), so the tokens are the plain loop's.

A replica with one row, a step with padding rows, a group of one replica, or WaS runs the plain
layer loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gearshift.worker.attention.core import AttentionCore
from gearshift.worker.attention.metadata import AttentionMetadata
from gearshift.worker.kv.cache import LayerKV
from gearshift.worker.model.llama import LlamaDecoderLayer, Rope
from gearshift.worker.policies.sidp.cas import CasExchange, LayerCall, split_rows
from gearshift.worker.policies.sidp.ffn import FfnService, Mode


@dataclass
class CasOverlap:
    """The model's layer loop in CaS steps (``LlamaForCausalLM.layer_runner``)."""

    service: FfnService
    cas: CasExchange

    def __call__(
        self,
        layers: Sequence[LlamaDecoderLayer],
        rope: Rope,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_caches: Sequence[LayerKV],
        meta: AttentionMetadata,
        core: AttentionCore,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        cas = self.cas
        if self.service.mode != Mode.CAS or not cas.overlap or cas.channel is None:
            return None  # WaS, overlap off, or one replica (it owns every layer: no exchange)
        if meta.num_padding:
            return None
        rows = hidden.shape[0]
        sizes = split_rows(rows, True)
        if len(sizes) < 2:
            return None  # one row cannot be split
        cut = sizes[0]
        metas = meta.split(cut)
        halves = (slice(0, cut), slice(cut, rows))
        ropes = [(rope[0][h], rope[1][h]) for h in halves]
        hid = [hidden[h] for h in halves]
        res: list[torch.Tensor | None] = [None if residual is None else residual[h] for h in halves]
        tp = self.service.tp
        prev: LayerCall | None = None
        for index, (layer, kv) in enumerate(zip(layers, kv_caches, strict=True)):
            call = cas.call(index, self.service.owned.get(index), rows)
            for m in (0, 1):
                if prev is not None:
                    # The replica's TP ranks add up their shards' partial sums, half by half.
                    hid[m] = tp.all_reduce(prev.take(m))
                # What stays in flight while this half's attention runs: A's rows of this
                # layer (for B), or B's answer of the previous layer (for A).
                if m == 1:
                    cas.note_overlap(call, 0)
                else:
                    cas.note_overlap(prev, 1)
                normed, res[m] = layer.attend(ropes[m], hid[m], res[m], kv, metas[m], core)
                call.give(m, normed)
            prev = call
        assert prev is not None, "a model without layers has no CaS step"
        out = [tp.all_reduce(prev.take(m)) for m in (0, 1)]
        last = [r for r in res if r is not None]
        return torch.cat(out), torch.cat(last)
