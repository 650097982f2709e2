"""Compute-as-a-Service: non-owners ship a layer's activations to its owner, which runs one FFN
over every replica's rows and returns each its slice (SiDP §4.3).

Replicas step together in this mode: the step's control exchange (``group_step.py``) tells every
rank how many rows each replica has. A replica with none (idle, running a dummy step) sends
nothing and its owner skips it (dummy skipping); with skipping off it sends one zero row per
layer that the owner computes and discards, as a plain lock-step implementation would.

With ``tp`` ranks per replica (the paper runs e.g. TP 2 × DP 4 but does not spell out the
exchange) it runs per TP rank: TP rank t of each replica sends its rows (the full hidden state,
which every TP rank of a replica holds after attention) to TP rank t of the owner, which runs its
FFN shard over the fused rows and returns each sender the partial sums of its rows. Every replica
then all-reduces its partial sums within its own TP group, as in a plain TP FFN, so the owner
never reduces rows that are not its own, and the dp × tp ranks form tp independent exchanges of
dp ranks each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch

from gearshift.worker.comm import CommGroup
from gearshift.worker.p2p import P2P
from gearshift.worker.policies.sidp.ffn import run_ffn
from gearshift.worker.policies.sidp.ownership import Ownership
from gearshift.worker.policies.sidp.shared_weights import FfnLayout, FfnWeights


@dataclass
class CasStats:
    fused_rows: int = 0  # rows the owner's fused FFN ran, this rank's own included
    skipped_dummies: int = 0  # (layer, idle replica) pairs an owner did not wait for


@dataclass
class CasExchange:
    """This rank's side of every layer's activation exchange."""

    own: Ownership
    rank: int
    world: CommGroup  # this TP rank's peers: TP rank t of every replica, group rank = replica
    cas_slots: int
    layout: FfnLayout
    dtype: torch.dtype
    dummy_skipping: bool = True
    owned_weights: dict[int, FfnWeights] = field(default_factory=dict)  # layers this rank owns
    rows: list[int] = field(default_factory=list)  # this step's rows per replica
    stats: CasStats = field(default_factory=CasStats)
    tp_rank: int = 0  # TP rank 0's partial sums carry down's bias
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    timeout: timedelta = timedelta(seconds=120)

    def __post_init__(self) -> None:
        # Staging buffers, used in turn, so a layer's buffer is not reused while an earlier
        # layer's slices may still be in flight (§4.4 CaS slots).
        self._staging = [self._empty(0)] * self.cas_slots
        self._next = 0
        # Device rows as they are over NCCL (one GPU per replica); through host memory where
        # gloo carries them (ranks sharing one GPU). Every rank of ``world`` builds it together.
        self.channel: P2P | None = None
        if self.world.size > 1:
            name = f"sidp cas (tp rank {self.tp_rank})"
            self.channel = P2P(self.world, name, self.device, self.timeout)

    def _empty(self, n: int) -> torch.Tensor:
        return torch.empty(n, self.layout.hidden, dtype=self.dtype, device=self.device)

    def _link(self) -> P2P:
        assert self.channel is not None, "a replica exchanges rows only with peers"
        return self.channel

    def begin_step(self, rows: list[int]) -> None:
        self.rows = list(rows)

    def _senders(self, owner: int) -> list[int]:
        """Replicas whose rows the owner of a layer receives this step."""
        return [
            r
            for r in range(self.own.dp)
            if r != owner and (self.rows[r] > 0 or not self.dummy_skipping)
        ]

    def _rows_of(self, r: int) -> int:
        # Without skipping an idle replica still sends a zero row.
        return self.rows[r] if self.rows[r] > 0 else 1

    def _stage(self, n: int) -> torch.Tensor:
        buf = self._staging[self._next]
        if buf.shape[0] < n:
            buf = self._empty(n)
            self._staging[self._next] = buf
        self._next = (self._next + 1) % self.cas_slots
        return buf[:n]

    def run(self, layer: int, x: torch.Tensor, owned: FfnWeights | None) -> torch.Tensor:
        owner = self.own.owner(layer)
        if owner == self.rank:
            assert owned is not None
            return self._serve(layer, x, owned)
        if x.shape[0] == 0 and self.dummy_skipping:
            return x  # a dummy step sends nothing (§4.3 dummy skipping)
        payload = x if x.shape[0] else torch.zeros(1, x.shape[1], dtype=x.dtype, device=x.device)
        # Rows to the owner, then its answer: sequential opposite directions (the owner needs
        # every replica's rows before it answers any), so the send is waited for first.
        link = self._link()
        link.send(payload, owner, f"cas rows of layer {layer}").wait()
        out = torch.empty_like(payload)
        link.recv(out, owner, f"cas answer of layer {layer}").wait()
        return out[: x.shape[0]]

    def _serve(self, layer: int, x: torch.Tensor, owned: FfnWeights) -> torch.Tensor:
        senders = self._senders(self.rank)
        if self.dummy_skipping:
            self.stats.skipped_dummies += sum(
                1 for r in range(self.own.dp) if r != self.rank and self.rows[r] == 0
            )
        sizes = [x.shape[0]] + [self._rows_of(r) for r in senders]
        staging = self._stage(sum(sizes))
        parts = list(staging.split(sizes))
        parts[0].copy_(x)
        link = self._link() if senders else None
        recvs = [
            link.recv(part, r, f"cas rows of layer {layer}")
            for part, r in zip(parts[1:], senders, strict=True)
            if link is not None
        ]
        for pending in recvs:
            pending.wait()
        fused = run_ffn(staging, owned, self.tp_rank == 0)
        self.stats.fused_rows += fused.shape[0]
        out = list(fused.split(sizes))
        sends = [
            link.send(part, r, f"cas answer of layer {layer}")
            for part, r in zip(out[1:], senders, strict=True)
            if link is not None
        ]
        for pending in sends:
            pending.wait()
        return out[0]

    @torch.inference_mode()
    def dummy_step(self) -> None:
        """An idle replica's step: serve the layers it owns, send nothing for the others."""
        empty = self._empty(0)
        for layer in range(self.own.num_layers):
            owner = self.own.owner(layer)
            if owner == self.rank:
                if self._senders(owner):
                    self._serve(layer, empty, self.owned_weights[layer])
            elif not self.dummy_skipping:
                self.run(layer, empty, None)

    def close(self) -> None:
        self._staging = []
        if self.channel is not None:
            self.channel.close()
