"""Ulysses sequence parallelism for inference around any attention core (Shift §3.2).

Each SP rank enters attention with its slice of the step's tokens and all heads of its TP shard;
one all-to-all turns that into all tokens for ``1/SP`` of those heads (Alg. 2 line 4), the inner
attention runs over the paged cache exactly as it would on one rank, and the reverse all-to-all
restores the token slice (line 6). When SP exceeds the KV heads of a TP shard, KV heads are
replicated in the network by Alg. 1 instead of being split.
"""

from __future__ import annotations

import torch

from gearshift.worker.attention.core import AttentionCore
from gearshift.worker.attention.metadata import AttentionMetadata
from gearshift.worker.comm import CommGroup
from gearshift.worker.kv.cache import LayerKV


class UlyssesAttention:
    """An AttentionCore that splits heads instead of tokens across the SP group."""

    def __init__(
        self, inner: AttentionCore, sp: CommGroup, kv_aa: CommGroup, kv_ag: CommGroup
    ) -> None:
        self.inner = inner
        self.sp = sp
        self.kv_aa = kv_aa
        self.kv_ag = kv_ag

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q [n/SP, Hq_tp, D], k/v [n/SP, Hkv_tp, D] → [n/SP, Hq_tp, D]."""
        q_all, k_all, v_all = self._to_heads(q, k, v)
        out = self.inner.forward(q_all, k_all, v_all, kv, meta)
        return self._to_tokens(out, q.shape[0])

    def forward_lse(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` plus the log-sum-exp rows [n/SP, Hq_tp], moved back like the output."""
        m = q.shape[0]
        q_all, k_all, v_all = self._to_heads(q, k, v)
        out, lse = self.inner.forward_lse(q_all, k_all, v_all, kv, meta)
        return self._to_tokens(out, m), self._to_tokens(lse.unsqueeze(-1), m).squeeze(-1)

    def _to_heads(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Alg. 2 line 4: token slices of all heads → all tokens of 1/SP of the heads."""
        sp = self.sp.size
        m, hq_tp, dim = q.shape
        hkv_tp = k.shape[1]
        hq = hq_tp // sp
        if hkv_tp % sp == 0:
            # One fused all-to-all for q, k and v: destination rank first, then its heads.
            hk = hkv_tp // sp
            packed = torch.cat(
                (q.view(m, sp, hq, dim), k.view(m, sp, hk, dim), v.view(m, sp, hk, dim)), dim=2
            )
            full = self.sp.all_to_all(packed.transpose(0, 1)).reshape(sp * m, hq + 2 * hk, dim)
            q_all, k_all, v_all = full.split((hq, hk, hk), dim=1)
        else:
            q_all = self.sp.all_to_all(q.view(m, sp, hq, dim).transpose(0, 1)).reshape(
                sp * m, hq, dim
            )
            k_all, v_all = self._replicate_kv(k, v)
        return q_all, k_all.contiguous(), v_all.contiguous()

    def _to_tokens(self, out: torch.Tensor, m: int) -> torch.Tensor:
        """Line 6: [n, Hq_tp/SP, D] → this rank's token slice of all its TP heads."""
        sp = self.sp.size
        hq, dim = out.shape[1], out.shape[2]
        back = self.sp.all_to_all(out.view(sp, m, hq, dim))  # [source head chunk, m, hq, D]
        return back.transpose(0, 1).reshape(m, sp * hq, dim)

    def _replicate_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Alg. 1: every rank ends with all tokens of the one KV head it serves."""
        m, heads, dim = k.shape
        r = self.kv_ag.size  # replicas of each head = SP / heads
        pairs = torch.stack((k, v), dim=2)  # [m, heads, 2, D]
        # Line 4: SP_AA all-to-all — member j receives head j of everyone's token slice.
        mine = self.kv_aa.all_to_all(pairs.transpose(0, 1))  # [heads: source j, m, 2, D]
        # Line 5: SP_AG all-gather among the ranks serving the same head.
        gathered = self.kv_ag.all_gather(mine.unsqueeze(0), dim=0)  # [r: i, heads: j, m, 2, D]
        # Line 6: the slice of SP rank j * r + i came from AA member j via AG member i.
        tokens = gathered.transpose(0, 1).reshape(heads * r * m, 2, dim)
        return tokens[:, 0:1], tokens[:, 1:2]
