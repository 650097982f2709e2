"""A Tetris decode instance's ranks in the hand-off (Tetris §4.2, Fig. 7): the receives of the
pieces its leader's ``admission.DecodeAdmission`` granted.

On every rank of the instance, ``ReceiveHook`` posts the receives a plan's section names, before
the plan's forward pass, on the piece's slot channel (``handoff.py``), and writes the rows into
the rank's paged cache.

A streamed piece (``layerwise_transfer``) takes two plans: the first posts its per-layer receives
on every rank as soon as its slot is granted (they fill in the background while the pool still
computes), the second, once its member has sent every layer, waits for them and writes the rows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from gearshift.worker.engine.model_runner import ModelRunner
from gearshift.worker.engine.plan import StepPlan
from gearshift.worker.p2p import P2P
from gearshift.worker.policies.tetris.admission import (
    SECTION,
    STREAM,
    decode_pieces,
    decode_stream,
)
from gearshift.worker.policies.tetris.handoff import (
    Posted,
    complete_piece,
    post_piece,
    receive_piece,
)

log = logging.getLogger(__name__)


@dataclass
class ReceiveHook:
    """Every decode rank: the plan's pieces, received before its forward pass on their slots'
    ``channels`` (one per transfer slot, over the group's global ranks). A piece that fails
    (its sender died mid-send) is recorded, and the step goes on so the instance's ranks stay
    in step."""

    channels: list[P2P]
    failed_sources: list[int] = field(default_factory=list)
    # A prefill instance's index -> what ``receive_piece`` takes as its source (its ranks and
    # the heads each sends this rank, for TP > 1); None: the index is the rank (TP 1).
    sources: Callable[[int], int | list[tuple[int, int]]] | None = None

    posted: dict[int, tuple[int, Posted]] = field(default_factory=dict)  # xfer -> (src, recvs)

    def _source(self, src: int) -> int | list[tuple[int, int]]:
        return src if self.sources is None else self.sources(src)

    def before_step(self, runner: ModelRunner, plan: StepPlan) -> None:
        section = plan.section(SECTION)
        pieces = decode_pieces(section.tolist()) if section is not None else []
        for src, slot, xfer, rows, block_ids in pieces:
            try:
                source, channel = self._source(src), self.channels[slot]
                receive_piece(source, rows, channel, runner.kv_caches, block_ids, xfer)
            except RuntimeError as exc:
                log.error("KV piece from rank %d failed: %s", src, str(exc).splitlines()[0])
                self.failed_sources.append(src)
        section = plan.section(STREAM)
        if section is None:
            return
        posts, completes = decode_stream(section.tolist())
        for src, slot, xfer, rows in posts:
            channel = self.channels[slot]
            post = post_piece(self._source(src), rows, channel, runner.kv_caches, xfer)
            self.posted[xfer] = (src, post)
        for xfer, block_ids in completes:
            src, post = self.posted.pop(xfer)
            try:
                complete_piece(post, runner.kv_caches, block_ids)
            except RuntimeError as exc:
                log.error("KV stream from rank %d failed: %s", src, str(exc).splitlines()[0])
                self.failed_sources.append(src)

    def close(self) -> None:
        return None
