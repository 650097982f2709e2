"""The transfer handshake of a Tetris group (Tetris §4.2): one thread per prefill instance asks
the chosen decode instance's receive manager for a slot for each of its pieces (granted in
first-handshake order, bounded wait), then lets the member send.

Whole hand-off: the member offered the piece when its prefill ended; the grant is a ``Go``, and
the decode instance is told to receive the piece only when the member reports it sent (the
reader). Layer-wise: every piece is handshaken when the request is submitted; a grant makes the
decode ranks post the piece's receives at once (``Post``) and the member send each layer as its
last chunk computes it (``StreamGo``).
"""

from __future__ import annotations

import queue
import time

from gearshift.worker.errors import GroupFailure
from gearshift.worker.launch.tetris.messages import Cancel, Go, Post, StreamGo
from gearshift.worker.launch.tetris.state import Granted, GroupState
from gearshift.worker.policies.tetris.transfer import TransferError

POLL_S = 0.2  # how often an idle handshake thread looks at the group's stop flag


def handshake_loop(group: GroupState, m: int) -> None:
    """Prefill instance ``m``'s pieces, in the order they were queued, until the group stops."""
    while not group.stop.is_set():
        try:
            rid, piece = group.handshakes[m].get(timeout=POLL_S)
        except queue.Empty:
            continue
        with group.lock:
            req = group.requests.get(rid)
        if req is None:
            group.to_pool(m, Cancel(rid))
            continue
        started = time.monotonic()
        try:
            slot = group.managers[req.decode].acquire(rid, group.timeout_s)
        except TransferError as exc:
            group.to_pool(m, Cancel(rid))
            group.fail(rid, GroupFailure(f"KV transfer: {exc}"))
            continue
        with group.lock:
            group.transfer.waits += 1
            group.transfer.wait_seconds += time.monotonic() - started
        _, count = req.pieces[m][piece]
        with group.lock:
            # Under the lock: an abort either came first (then no go) or comes after the go,
            # whose "sent" still makes the decode instance receive (and drop) the piece.
            if rid not in group.requests or m in group.dead_pool:
                group.managers[req.decode].abort(rid)
                group.to_pool(m, Cancel(rid))
                continue
            senders = len(group.pool_conns[m])
            xfer = next(group.xfers)  # the piece's messages carry it (their labels)
            group.granted[(m, rid, piece)] = Granted(req.decode, count, senders, slot, xfer)
            if not group.layerwise:
                group.to_pool(m, Go(rid, piece, slot, xfer))
                continue
            # Streamed: the decode ranks post the piece's receives now, and the member sends
            # each layer as it is computed, both on the slot's channel.
            group.send(group.decode_conns[req.decode], Post(rid, m, count, piece, slot, xfer))
            receivers = tuple(group.policy.decode_ranks(req.decode))
            group.to_pool(m, StreamGo(rid, piece, slot, xfer, count, receivers))
