"""The layer-wise hand-off (``layerwise_transfer``, Tetris §4.2): a prefill rank's pieces of one
request leave layer by layer while the prefill still computes.

The handshake runs while the prefill computes (§4.2: "integrated into layer-wise cache
transmission", overlapped with the prefill): the decode ranks post every receive of a piece as
soon as its slot is granted (``handoff.post_piece``), and the member sends each layer's rows the
moment the plan's last chunk has computed that layer (``LayerStream.add_layer``), on the piece's
slot channel, layers in order and the positions last (``handoff.piece_label``): the order its
receiver posted. Two pieces in flight hold two slots, so one member streaming several pieces at
once never interleaves them on one channel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gearshift.worker.p2p import P2P
from gearshift.worker.policies.tetris.handoff import Sending, piece_label, routes


@dataclass
class Grant:
    """One granted piece of a stream: its slot, its grant number and its sends so far."""

    slot: int
    xfer: int
    sending: Sending
    layers: int = 0  # layers sent so far
    early: int = 0  # of them, layers sent while the prefill still computed
    done: bool = False  # every layer and the positions sent


class LayerStream:
    """A prefill rank's pieces of one request, streamed layer by layer.

    ``add_layer`` gets each layer's rows of this rank (the plan's last chunk has just computed
    them: the rebalanced history then the chunk's rows, the holding's order) and sends them for
    every piece granted so far; a piece granted later first catches up on the computed layers.
    The positions go last (``finish``). A stream whose prefill failed (``fail``) sends zeros for
    whatever it cannot send, so no decode rank is left with a receive posted for a grant (the
    group tells it to drop the piece)."""

    def __init__(
        self,
        pieces: list[tuple[int, int]],
        receivers: tuple[int, ...],
        channels: Sequence[P2P],
        tp: tuple[int, int],
        kv_heads: int,
        row: tuple[int, int, torch.dtype, torch.device],
        layers: int,
    ) -> None:
        self.pieces, self.channels, self.layers = pieces, channels, layers
        self.routes = routes(receivers, tp, kv_heads)
        self.row = row  # (this rank's KV heads, head dim, dtype, device)
        self.rows: list[torch.Tensor] = []  # per computed layer: [n, 2, heads, D]
        self.positions: torch.Tensor | None = None
        self.failed = False
        self.error: RuntimeError | None = None  # a send that could not start
        self.cancelled = False
        self.grants: dict[int, Grant] = {}

    def grant(self, piece: int, slot: int, xfer: int) -> Grant:
        """Piece ``piece`` may go on slot ``slot`` as grant ``xfer``: sends what is computed."""
        grant = Grant(slot, xfer, Sending())
        self.grants[piece] = grant
        self._advance(piece, grant)
        return grant

    def add_layer(self, kv: torch.Tensor) -> None:
        self.rows.append(kv)
        for piece, grant in self.grants.items():
            self._advance(piece, grant)

    def finish(self, positions: torch.Tensor) -> list[int]:
        """Every layer is computed: the positions go; returns the pieces now wholly sent."""
        self.positions = positions
        return self._complete()

    def fail(self) -> list[int]:
        """The prefill failed: the granted pieces are filled up with zeros; returns them."""
        self.failed = True
        return self._complete()

    @property
    def broken(self) -> bool:
        """Its prefill failed, or a send could not start: what it sent is not the KV."""
        return self.failed or self.error is not None

    @property
    def settled(self) -> bool:
        """Nothing more to send: the prefill ran (or failed), and every piece is sent, or the
        request was cancelled (no more grants come) and its granted pieces are sent."""
        ran = self.positions is not None or self.failed
        granted = len(self.grants) == len(self.pieces) or self.cancelled
        return ran and granted and all(g.done for g in self.grants.values())

    def _complete(self) -> list[int]:
        out = []
        for piece, grant in self.grants.items():
            if not grant.done:
                self._advance(piece, grant)
                out.append(piece)
        return out

    def _advance(self, piece: int, grant: Grant) -> None:
        start, count = self.pieces[piece]
        heads, head_dim, dtype, device = self.row
        while grant.layers < len(self.rows) or (self.failed and grant.layers < self.layers):
            if grant.layers < len(self.rows):
                kv = self.rows[grant.layers][start : start + count]
            else:
                kv = torch.zeros((count, 2, heads, head_dim), dtype=dtype, device=device)
            self._send(grant, kv, f"L{grant.layers}", True)
            grant.layers += 1
            grant.early += self.positions is None and not self.failed
        ready = self.positions is not None or self.failed
        if grant.layers == self.layers and ready and not grant.done:
            if self.positions is not None and not self.failed:
                pos = self.positions[start : start + count]
            else:
                pos = torch.zeros(count, dtype=torch.int64, device=device)
            self._send(grant, pos, "positions", False)
            grant.done = True

    def _send(self, grant: Grant, rows: torch.Tensor, what: str, heads: bool) -> None:
        channel = self.channels[grant.slot]
        for dst, local in self.routes:
            buf = rows[:, :, local] if heads else rows
            try:
                pending = channel.send(buf, dst, piece_label(grant.xfer, what))
            except RuntimeError as exc:  # a decode rank is gone (the group ends): not sent
                self.error = self.error or exc
                continue
            grant.sending.pending.append(pending)
