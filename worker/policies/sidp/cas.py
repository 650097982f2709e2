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

Overlap (``overlap``, the policy's ``cas_overlap``): "P2P transfers are issued by non-owners and
can be overlapped with the computation of earlier steps in the decode iteration" (§4.3). A
replica with two rows or more runs its step as two micro-batches (``overlap.py``): the first
half's rows are on their way to a layer's owner while the second half's attention of that layer
runs, and the second half's answer is on its way back while the first half's attention of the
next layer runs. Every replica's rows still reach the owner, which runs one fused GEMM per layer
over all of them; a replica sends its rows as one message per micro-batch (``split_rows``: a
function of its row count, which every owner knows from the step's control exchange).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch

from gearshift.worker.comm import CommGroup
from gearshift.worker.p2p import P2P, Pending
from gearshift.worker.policies.sidp.ffn import run_ffn
from gearshift.worker.policies.sidp.ownership import Ownership
from gearshift.worker.policies.sidp.shared_weights import FfnLayout, FfnWeights


@dataclass
class CasStats:
    fused_rows: int = 0  # rows the owner's fused FFN ran, this rank's own included
    skipped_dummies: int = 0  # (layer, idle replica) pairs an owner did not wait for
    # Micro-batch messages (rows to an owner, or its answer) posted and not yet waited for while
    # the other micro-batch's attention ran: the overlap, counted by construction.
    overlapped: int = 0
    # Of those, the ones not yet complete when that attention began (depends on timing: a
    # diagnostic, not a guarantee).
    overlapped_moving: int = 0


def split_rows(rows: int, overlap: bool) -> list[int]:
    """How a replica's ``rows`` rows of a step travel to an owner: two micro-batches when
    overlapping and it has two rows or more (the first the larger), else one (none for 0)."""
    if rows <= 0:
        return []
    if overlap and rows >= 2:
        return [(rows + 1) // 2, rows // 2]
    return [rows]


class LayerCall:
    """One layer's exchange on this rank for one step, fed one micro-batch at a time.

    A non-owner posts each part's rows to the owner as it is given (``give``); once all are
    posted it waits for the sends and posts the answers' receives, which ``take`` waits for. An
    owner stages its own parts; once all are given it receives every sender's parts, runs one
    GEMM over all rows and posts the answers (waited for before any later traffic the other way
    with that peer, or at the next step)."""

    def __init__(self, ex: CasExchange, layer: int, owned: FfnWeights | None, rows: int) -> None:
        self.ex, self.layer, self.owned = ex, layer, owned
        self.owner = ex.own.owner(layer)
        self.serving = self.owner == ex.rank
        self.sizes = split_rows(rows, ex.overlap)
        self.rows = rows
        self._given = 0
        self._sends: list[Pending] = []
        self._recvs: list[tuple[Pending, torch.Tensor]] = []
        self._out: list[torch.Tensor] = []
        if self.serving:
            assert owned is not None
            senders = ex._senders(self.owner)
            self._senders = [(r, n) for r in senders for n in ex.parts(r)]
            staged = [rows] + [n for _, n in self._senders]
            self._staging = ex._stage(sum(staged))
        elif not self.sizes and not ex.dummy_skipping:
            self.sizes = [1]  # an idle replica without skipping sends one zero row
        if not self.sizes:
            self._finish()  # nothing of this rank's own: an owner serves the others at once

    @property
    def done_giving(self) -> bool:
        return self._given == len(self.sizes)

    def give(self, part: int, x: torch.Tensor) -> None:
        """Part ``part``'s rows (parts are given in order)."""
        assert part == self._given and not self.done_giving, (part, self._given)
        self._given += 1
        if self.serving:
            start = sum(self.sizes[:part])
            self._staging[start : start + x.shape[0]].copy_(x)
        else:
            payload = (
                x if x.shape[0] else torch.zeros(1, x.shape[1], dtype=x.dtype, device=x.device)
            )
            self._sends.append(
                self.ex._send(payload, self.owner, f"cas rows of layer {self.layer}")
            )
        if self.done_giving:
            self._finish()

    def take(self, part: int) -> torch.Tensor:
        """Part ``part``'s FFN output (a TP shard's partial sum); waits for it."""
        assert self.done_giving
        if self.serving:
            return self._out[part]
        pending, out = self._recvs[part]
        pending.wait()
        return out if self.rows else out[:0]  # an idle replica's zero row is dropped

    def outstanding(self, part: int) -> Pending | None:
        """Part ``part``'s message still posted and not waited for, if any."""
        if self.serving:
            return None
        if self.done_giving:
            pending = self._recvs[part][0] if part < len(self._recvs) else None
        else:
            pending = self._sends[part] if part < len(self._sends) else None
        return pending if pending is not None and not pending.waited else None

    def _finish(self) -> None:
        if self.serving:
            self._serve()
            return
        # Rows first, then the answers: the owner answers once it has every replica's rows.
        for pending in self._sends:
            pending.wait()
        label = f"cas answer of layer {self.layer}"
        for n in self.sizes:
            out = self.ex._empty(n)
            self._recvs.append((self.ex._recv(out, self.owner, label), out))

    def _serve(self) -> None:
        ex = self.ex
        if ex.dummy_skipping:
            ex.stats.skipped_dummies += sum(
                1 for r in range(ex.own.dp) if r != ex.rank and ex.rows[r] == 0
            )
        sizes = [self.rows] + [n for _, n in self._senders]
        parts = list(self._staging.split(sizes))
        label = f"cas rows of layer {self.layer}"
        recvs = [
            ex._recv(part, r, label) for part, (r, _) in zip(parts[1:], self._senders, strict=True)
        ]
        for pending in recvs:
            pending.wait()
        assert self.owned is not None
        fused = run_ffn(self._staging, self.owned, ex.tp_rank == 0)
        ex.stats.fused_rows += fused.shape[0]
        out = list(fused.split(sizes))
        label = f"cas answer of layer {self.layer}"
        for part, (r, _) in zip(out[1:], self._senders, strict=True):
            ex._send(part, r, label)
        self._out = list(out[0].split(self.sizes)) if self.sizes else []


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
    overlap: bool = False  # micro-batches whose exchange overlaps attention (overlap.py)

    def __post_init__(self) -> None:
        # Staging buffers, used in turn, so a layer's buffer is not reused while an earlier
        # layer's slices may still be in flight (§4.4 CaS slots).
        self._staging = [self._empty(0)] * self.cas_slots
        self._next = 0
        # Posted messages not yet waited for, per peer: (is a send, pending).
        self._unwaited: dict[int, list[tuple[bool, Pending]]] = {}
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
        self.settle()
        self.rows = list(rows)

    def settle(self) -> None:
        """Wait for every message still posted (an owner's last answers)."""
        for mine in self._unwaited.values():
            for _, pending in mine:
                pending.wait()
        self._unwaited.clear()

    def _post(self, send: bool, tensor: torch.Tensor, peer: int, label: str) -> Pending:
        # NCCL runs a pair's messages in posting order: a message the other way that is still
        # posted is waited for first (P2P's rules refuse it otherwise).
        mine = self._unwaited.setdefault(peer, [])
        for other_send, pending in mine:
            if other_send != send:
                pending.wait()
        link = self._link()
        pending = link.send(tensor, peer, label) if send else link.recv(tensor, peer, label)
        mine[:] = [(s, p) for s, p in mine if not p.waited] + [(send, pending)]
        return pending

    def _send(self, tensor: torch.Tensor, peer: int, label: str) -> Pending:
        return self._post(True, tensor, peer, label)

    def _recv(self, buffer: torch.Tensor, peer: int, label: str) -> Pending:
        return self._post(False, buffer, peer, label)

    def _senders(self, owner: int) -> list[int]:
        """Replicas whose rows the owner of a layer receives this step."""
        return [
            r
            for r in range(self.own.dp)
            if r != owner and (self.rows[r] > 0 or not self.dummy_skipping)
        ]

    def parts(self, r: int) -> list[int]:
        """The messages replica ``r`` sends an owner this step, by rows."""
        if self.rows[r] == 0:
            return [] if self.dummy_skipping else [1]  # without skipping: one zero row
        return split_rows(self.rows[r], self.overlap)

    def _stage(self, n: int) -> torch.Tensor:
        buf = self._staging[self._next]
        if buf.shape[0] < n:
            buf = self._empty(n)
            self._staging[self._next] = buf
        self._next = (self._next + 1) % self.cas_slots
        return buf[:n]

    def call(self, layer: int, owned: FfnWeights | None, rows: int) -> LayerCall:
        """Layer ``layer``'s exchange of this step, this rank having ``rows`` rows."""
        return LayerCall(self, layer, owned, rows)

    def note_overlap(self, call: LayerCall | None, part: int) -> None:
        """The other micro-batch's attention is about to run: count ``part`` of ``call`` if its
        message is still posted."""
        pending = call.outstanding(part) if call is not None else None
        if pending is not None:
            self.stats.overlapped += 1
            self.stats.overlapped_moving += int(not pending.done())

    def run(self, layer: int, x: torch.Tensor, owned: FfnWeights | None) -> torch.Tensor:
        """Layer ``layer``'s FFN of all of this rank's rows ``x`` at once (no micro-batches to
        overlap; the rows still travel as ``split_rows`` says)."""
        if x.shape[0] == 0 and self.dummy_skipping and self.own.owner(layer) != self.rank:
            return x  # a dummy step sends nothing (§4.3 dummy skipping)
        call = self.call(layer, owned, x.shape[0])
        for part, rows in enumerate(x.split(call.sizes) if x.shape[0] else [x]):
            if not call.done_giving:
                call.give(part, rows)
        outs = [call.take(p) for p in range(len(call.sizes))]
        if not outs:
            return x
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    @torch.inference_mode()
    def dummy_step(self) -> None:
        """An idle replica's step: serve the layers it owns, send nothing for the others."""
        empty = self._empty(0)
        for layer in range(self.own.num_layers):
            owner = self.own.owner(layer)
            if owner == self.rank:
                if self._senders(owner):
                    self.call(layer, self.owned_weights[layer], 0)
            elif not self.dummy_skipping:
                self.run(layer, empty, None)
        self.settle()

    def close(self) -> None:
        self._staging = []
        if self.channel is not None:
            self.channel.close()
