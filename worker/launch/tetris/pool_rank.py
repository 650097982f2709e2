"""A prefill instance's rank: each request's chunk plan on the pool, then its KV handed over
piece by piece (Tetris §4.1 CDSP execution, §4.2 hand-off).

The member runs a request's chunks when its ``Prefill`` arrives, then offers its pieces
(``Offer``, one per piece) and goes on with its next message; each granted piece (``Go``) is
started in the background (``handoff.start_piece``) and reported ``WholeSent``, so the member
computes its next prefill while its KV is still leaving (§4.2). A grant that arrives during a
later prefill starts its sends between that prefill's layers.

With ``layerwise_transfer`` there is no ``Offer``: the controller handshakes every piece when
the request arrives, and a ``StreamGo`` (read between layers too, while a prefill computes)
starts the piece's ``LayerStream``: each layer of the last chunk leaves as soon as it is
computed. A granted piece is always sent whole, zeros if its prefill failed (``StreamSent``
with ``sent`` False), since its decode ranks have posted the receives.

Every rank of an instance of TP > 1 gets the same messages and runs the same plans on its head
shard (its ring: the same TP rank of the other instances); its TP rank 0 speaks for the instance
(``Prefilled``, ``Offer``, ``Probed``), and each rank reports its own share of a piece sent.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from gearshift.worker.launch.rank import RankState
from gearshift.worker.launch.tetris.links import MemberLink
from gearshift.worker.launch.tetris.messages import (
    Cancel,
    Go,
    Offer,
    PieceRows,
    Prefill,
    Prefilled,
    PrefillFailed,
    Probe,
    Probed,
    ProbeFailed,
    Stop,
    StreamGo,
    StreamSent,
    ToPool,
    WholeSent,
    WholeUnsent,
)
from gearshift.worker.model.llama import LlamaForCausalLM
from gearshift.worker.policies.tetris.channels import TetrisChannels
from gearshift.worker.policies.tetris.chunked_prefill import Pool, run_chunk_plan
from gearshift.worker.policies.tetris.handoff import Sending, start_piece
from gearshift.worker.policies.tetris.policy import TetrisPolicy
from gearshift.worker.policies.tetris.rebalance import Holding
from gearshift.worker.policies.tetris.stream import LayerStream


def first_line(exc: BaseException) -> str:
    """An exception's first line (gloo's messages run to many), for a failure report."""
    return (str(exc).splitlines() or [type(exc).__name__])[0]


@dataclass
class Offered:
    """A request whose pieces are offered but not all granted: its rows and where they go."""

    holding: Holding
    pieces: tuple[PieceRows, ...]
    receivers: tuple[int, ...]


class PoolMember:
    """One rank of a prefill instance, driven by the controller over ``link`` (see the module
    docstring)."""

    def __init__(self, state: RankState, policy: TetrisPolicy, link: MemberLink, rank: int) -> None:
        gear = state.model.gears[0]
        model = gear.model
        assert isinstance(model, LlamaForCausalLM)
        self.model = model
        channels: TetrisChannels = state.model.extra["channels"]
        self.slots = channels.slots  # the transfer slots' channels, by slot
        self.pool = Pool(policy.pool_comm(rank, channels), channels.pool, gear.core)
        _, _, j = policy.role(rank)
        self.speaks = j == 0
        self.rank = rank
        self.link = link
        cfg = model.config
        self.kv_heads = cfg.num_kv_heads
        self.layerwise = bool(policy.message.layerwise_transfer)
        self.layers = len(model.model.layers)
        weight = next(model.parameters())
        self.device = weight.device
        self.row = (model.num_kv_heads, cfg.head_dim, weight.dtype, weight.device)
        self.tp = (j, policy.prefill_tp)
        self.offered: dict[str, Offered] = {}
        self.streams: dict[str, LayerStream] = {}  # layerwise: requests with pieces to send
        self.deferred: collections.deque[ToPool] = collections.deque()  # read mid-prefill
        self.sending: list[Sending] = []  # started pieces whose sends may still be in flight

    def run(self) -> None:
        """Serve the controller's messages until ``Stop``."""
        while True:
            self.sending = [s for s in self.sending if not s.done()]
            msg = self.deferred.popleft() if self.deferred else self.link.recv()
            if isinstance(msg, Stop):
                return
            if isinstance(msg, Cancel):
                self.offered.pop(msg.rid, None)  # granted pieces are sent (the decode drops them)
                self._cancel(msg.rid)
            elif isinstance(msg, StreamGo):
                self._go_stream(msg)
            elif isinstance(msg, Go):
                self._go_whole(msg)
            elif isinstance(msg, Probe):
                self._probe(msg)
            else:
                self._prefill(msg)

    # ---- layer-wise hand-off -------------------------------------------------------------------

    def _stream_of(self, rid: str, mine: Sequence[PieceRows], receivers: tuple[int, ...]) -> None:
        if rid not in self.streams:
            self.streams[rid] = LayerStream(
                list(mine), receivers, self.slots, self.tp, self.kv_heads, self.row, self.layers
            )

    def _report(self, rid: str, stream: LayerStream, pieces: list[int]) -> None:
        for piece in pieces:
            grant = stream.grants[piece]
            self.sending.append(grant.sending)
            self.link.send(StreamSent(rid, piece, not stream.broken, grant.early, self.layers))
        if stream.settled:
            self.streams.pop(rid, None)

    def _go_stream(self, msg: StreamGo) -> None:
        stream = self.streams.get(msg.rid)
        if stream is None:  # its prefill failed and it settled: zeros, so nothing stays posted
            stream = LayerStream(
                [(0, msg.rows)],
                msg.receivers,
                self.slots,
                self.tp,
                self.kv_heads,
                self.row,
                self.layers,
            )
            stream.fail()
            granted = stream.grant(0, msg.slot, msg.xfer).done
            self._report(msg.rid, stream, [0] if granted else [])
            return
        if stream.grant(msg.piece, msg.slot, msg.xfer).done:
            self._report(msg.rid, stream, [msg.piece])

    def _cancel(self, rid: str) -> None:
        stream = self.streams.get(rid)
        if stream is not None:  # its granted pieces still go whole (the decode drops them)
            stream.cancelled = True
            if stream.settled:
                self.streams.pop(rid)

    def _between_layers(self, stream: LayerStream) -> Callable[[torch.Tensor], None]:
        def on_layer(kv: torch.Tensor) -> None:
            stream.add_layer(kv)
            while self.link.poll(0):  # grants that came while this prefill computes
                msg = self.link.recv()
                if isinstance(msg, StreamGo):
                    self._go_stream(msg)
                    continue
                if isinstance(msg, Prefill) and msg.pieces:
                    self._stream_of(msg.rid, msg.pieces, msg.receivers)
                self.deferred.append(msg)

        return on_layer

    # ---- whole hand-off ------------------------------------------------------------------------

    def _go_whole(self, msg: Go, mid_prefill: bool = False) -> None:
        """A granted piece of a prefill that is done: its send starts in the background."""
        held = self.offered.get(msg.rid)
        if held is None:
            self.link.send(WholeUnsent(msg.rid, msg.piece))
            return
        start, count = held.pieces[msg.piece]
        kv, positions = held.holding.kv, held.holding.positions
        rows = Holding(kv[start : start + count], positions[start : start + count])
        channel = self.slots[msg.slot]
        try:
            self.sending.append(
                start_piece(rows, held.receivers, channel, msg.xfer, self.tp, self.kv_heads)
            )
        except Exception as exc:  # noqa: BLE001 - a decode rank is gone: this request fails
            self.offered.pop(msg.rid, None)
            self.link.send(
                PrefillFailed(msg.rid, f"prefill instance {self.rank}: {first_line(exc)}")
            )
            return
        self.link.send(WholeSent(msg.rid, msg.piece, mid_prefill))
        if msg.piece == len(held.pieces) - 1:  # granted in order: the last piece is on its way
            self.offered.pop(msg.rid, None)

    def _grants_between_layers(self) -> None:
        # Whole hand-off: the grants of pieces offered before this prefill start their sends
        # between its layers, so a piece does not wait for the next prefill to end (§4.2: the
        # transfer overlaps the next request's compute). Everything else waits for the prefill,
        # and so does a grant behind its request's cancel, to keep their order.
        while self.offered and self.link.poll(0):
            msg = self.link.recv()
            if isinstance(msg, Go) and not any(
                isinstance(m, Cancel) and m.rid == msg.rid for m in self.deferred
            ):
                self._go_whole(msg, mid_prefill=True)
                continue
            self.deferred.append(msg)

    # ---- prefill and probes --------------------------------------------------------------------

    def _prefill(self, msg: Prefill) -> None:
        stream = None
        if self.layerwise and msg.pieces:
            self._stream_of(msg.rid, msg.pieces, msg.receivers)
            stream = self.streams[msg.rid]
        started = time.perf_counter()
        on_layer = self._between_layers(stream) if stream is not None else None
        poll = self._grants_between_layers if not self.layerwise else None
        ids = torch.tensor(msg.ids, dtype=torch.int64, device=self.device)
        try:
            result = run_chunk_plan(
                self.model, self.pool, list(msg.chunks), ids, None, on_layer, poll
            )
        except Exception as exc:  # noqa: BLE001 - a ring peer died or the plan broke: it fails
            if stream is not None:
                self._report(msg.rid, stream, stream.fail())
            self.link.send(
                PrefillFailed(msg.rid, f"prefill instance {self.rank}: {first_line(exc)}")
            )
            return
        if stream is not None:
            self._report(msg.rid, stream, stream.finish(result.holding.positions))
        elif msg.pieces and not self.layerwise:
            self.offered[msg.rid] = Offered(result.holding, msg.pieces, msg.receivers)
        if not self.speaks:
            return
        self.link.send(Prefilled(msg.rid, time.perf_counter() - started))
        if not self.layerwise:
            for i in range(len(msg.pieces)):
                self.link.send(Offer(msg.rid, i))

    def _probe(self, msg: Probe) -> None:
        """A ``TetrisGroup.profile`` point on this member: its chunk plan on a random prompt,
        each chunk timed (``run_chunk_plan``'s timings); nothing is kept or handed over. Only
        the instance's TP rank 0 reports."""
        gen = torch.Generator().manual_seed(msg.seed)
        vocab = self.model.config.vocab_size
        ids = torch.randint(0, vocab, (sum(c.length for c in msg.chunks),), generator=gen)
        timings: list[float] = []
        try:
            run_chunk_plan(self.model, self.pool, list(msg.chunks), ids.to(self.device), timings)
        except Exception as exc:  # noqa: BLE001 - a ring peer died: the probe fails
            if self.speaks:
                self.link.send(ProbeFailed(msg.pid, first_line(exc)))
            return
        if self.speaks:
            self.link.send(Probed(msg.pid, tuple(timings)))
