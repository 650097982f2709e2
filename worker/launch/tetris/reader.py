"""The reader thread of a Tetris group's controller: every rank's messages, in arrival order
per link, applied to the group's state (Tetris §4.2: the hand-off's progress, outputs, loads).

A member's "sent" is what lets the decode instance receive a piece: only then is the decode
leader told to (``Receive``, or for a streamed piece ``Complete``), so a decode step never
waits on a member that is still computing. The reader also asks each decode leader for a
``Snapshot`` every ``SNAPSHOT_S`` (the planner's view) and watches this host's processes.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from gearshift.worker.errors import GroupFailure, InvalidRequestError
from gearshift.worker.launch.tetris.failures import check_procs, link_lost, rank_down
from gearshift.worker.launch.tetris.links import DecodeLink, Link, PoolLink, wait_links
from gearshift.worker.launch.tetris.messages import (
    AskSnapshot,
    Complete,
    FromDecode,
    FromPool,
    Landed,
    Offer,
    Output,
    Prefilled,
    PrefillFailed,
    Probed,
    ProbeFailed,
    Receive,
    Refused,
    Snapshot,
    StreamSent,
    TransferFailed,
    WholeSent,
    WholeUnsent,
)
from gearshift.worker.launch.tetris.state import GroupState
from gearshift.worker.policies.tetris.transfer import TransferError
from gearshift.worker.wire import WireError

SNAPSHOT_S = 0.25  # how often each decode leader reports its engine's stats
WAIT_S = 0.1  # the longest the reader sleeps without looking at the processes


def read_loop(group: GroupState) -> None:
    """Until the group stops: read every link, apply each message, report lost ranks."""
    pools = {
        id(link): (m, group.policy.prefill_ranks(m)[j], link)
        for m in range(len(group.pool_conns))
        for j, link in enumerate(group.pool_conns[m])
    }
    decodes = {
        id(link): (d, group.policy.decode_ranks(d)[0], link)
        for d, link in enumerate(group.decode_conns)
    }
    live = group.all_links()
    next_stats = 0.0
    while not group.stop.is_set():
        now = time.monotonic()
        if now >= next_stats:
            next_stats = now + SNAPSHOT_S
            for decode in group.decode_conns:
                group.send(decode, AskSnapshot())
        try:
            ready = wait_links(live, WAIT_S)
        except OSError:
            ready = []
        for link in ready:
            role = "pool" if id(link) in pools else "decode"
            i, rank, _ = pools[id(link)] if role == "pool" else decodes[id(link)]
            try:
                _drain(group, pools, decodes, link)
            except WireError as exc:  # a rank that speaks another protocol is not one of ours
                with contextlib.suppress(ValueError):
                    live.remove(link)
                rank_down(group, rank, f"rank {rank} sent a bad control message ({exc})", live)
            except (EOFError, OSError):
                live.remove(link)
                link_lost(group, role, i, rank, live)
        check_procs(group, live)


def _drain(
    group: GroupState,
    pools: dict[int, tuple[int, int, PoolLink]],
    decodes: dict[int, tuple[int, int, DecodeLink]],
    link: Link[Any, Any],
) -> None:
    """Apply every message waiting on ``link``."""
    if id(link) in pools:
        m, _, pool = pools[id(link)]
        while pool.poll():
            on_pool(group, m, pool.recv())
        return
    d, _, decode = decodes[id(link)]
    while decode.poll():
        on_decode(group, d, decode.recv())


def on_pool(group: GroupState, m: int, msg: FromPool) -> None:
    """A message of prefill instance ``m``'s ranks."""
    if isinstance(msg, Offer):
        group.handshakes[m].put((msg.rid, msg.piece))
    elif isinstance(msg, Prefilled):
        with group.lock:
            req = group.requests.get(msg.rid)
            if req is not None:
                req.prefilled += 1
                if req.prefilled == 1:
                    group.transfer.prefills += 1
                    group.transfer.prefill_seconds += msg.seconds
                    group.transfer.planned_seconds += req.planned_s
    elif isinstance(msg, PrefillFailed):
        group.fail(msg.rid, GroupFailure(msg.why))
    elif isinstance(msg, WholeSent | WholeUnsent | StreamSent):
        _on_sent(group, m, msg)
    elif isinstance(msg, Probed | ProbeFailed):
        with group.probe_done:
            reply = msg.seconds if isinstance(msg, Probed) else msg.why
            group.probes.setdefault(msg.pid, {})[m] = reply
            group.probe_done.notify_all()


def _on_sent(group: GroupState, m: int, msg: WholeSent | WholeUnsent | StreamSent) -> None:
    # The member started the piece's sends: only now is the decode instance told to receive
    # it (or, streamed, to finish receiving it), so its step never waits on a member still
    # computing.
    sent = isinstance(msg, WholeSent) or (isinstance(msg, StreamSent) and msg.sent)
    key = (m, msg.rid, msg.piece)
    with group.lock:
        if isinstance(msg, StreamSent):  # a streamed piece's layers, and those sent early
            group.transfer.streamed_layers += msg.layers
            group.transfer.streamed_early += msg.early
        granted = group.granted.get(key)
        if granted is not None and not sent:
            granted.unsent = True
        counting = sent or group.layerwise  # streamed: every rank sends
        if granted is not None and counting and granted.senders > 1:
            granted.senders -= 1  # another TP rank of the instance has yet to report
            return
        group.granted.pop(key, None)
        if granted is not None and isinstance(msg, WholeSent):  # a whole piece, its last sender
            group.transfer.sent_mid_prefill += int(msg.mid_prefill)
    if granted is None:
        return
    decode = group.decode_conns[granted.decode]
    if group.layerwise:
        group.send(decode, Complete(msg.rid, m, msg.piece, granted.xfer, granted.unsent))
    elif sent:
        receive = Receive(msg.rid, m, granted.rows, msg.piece, granted.slot, granted.xfer)
        group.send(decode, receive)
    if granted.unsent or not sent:  # its prefill failed, or the member lost it: fail
        why = f"prefill instance {m} could not send piece {msg.piece}"
        group.fail(msg.rid, GroupFailure(why))


def on_decode(group: GroupState, d: int, msg: FromDecode) -> None:
    """A message of decode instance ``d``'s leader."""
    if isinstance(msg, Output):
        out = msg.out
        if out.finished:
            with group.lock:
                group.requests.pop(out.request_id, None)
        group.deliver(out.request_id, out)
    elif isinstance(msg, Landed):
        with contextlib.suppress(KeyError, TransferError):
            group.managers[d].landed(msg.rid, msg.slot)
        with group.lock:
            req = group.requests.get(msg.rid)
            if req is not None:
                req.landed += 1
                req.done = req.landed == req.total
    elif isinstance(msg, Refused):
        group.fail(msg.rid, InvalidRequestError(msg.field, msg.message))
    elif isinstance(msg, TransferFailed):
        group.fail(msg.rid, GroupFailure(msg.why))
    elif isinstance(msg, Snapshot):
        group.snapshots[d] = msg
