"""What the controller of a running Tetris group knows: its links to the ranks, the requests in
flight and their granted pieces, each instance's state, the hand-off's figures; and the moves
every part of the controller makes on it (send, fail a request, end the group).

The controller's threads share one ``GroupState``: the caller's (submit, abort, profile), the
reader (``reader.py``) and one handshake thread per prefill instance (``handshakes.py``).
``lock`` guards ``requests``, ``granted`` and ``transfer``; the pipes' order of messages to one
instance is the order they were sent under it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any, TypeVar

from torch.distributed import Store

from gearshift.worker.engine.outputs import RequestOutput
from gearshift.worker.errors import GroupFailure
from gearshift.worker.launch.processes import stop_processes
from gearshift.worker.launch.tetris.links import DecodeLink, Link, PoolLink
from gearshift.worker.launch.tetris.messages import Abort, Cancel, PieceRows, Snapshot, ToPool
from gearshift.worker.policies.tetris.policy import TetrisPolicy
from gearshift.worker.policies.tetris.transfer import ReceiveManager

log = logging.getLogger(__name__)
Out = TypeVar("Out")

Deliver = Callable[[str, RequestOutput | BaseException], None]


def pieces_of(
    rows: dict[int, int], row_bytes: int, buffer_bytes: int
) -> dict[int, list[PieceRows]]:
    """Each member's rows cut into runs of at most ``buffer_bytes`` (one row at least): the
    pieces it hands over, each after its own handshake (§4.2: a backend's buffer bounds a
    transfer)."""
    per = max(1, buffer_bytes // max(1, row_bytes))
    return {
        m: [(start, min(per, n - start)) for start in range(0, n, per)]
        for m, n in rows.items()
        if n
    }


@dataclass
class RequestState:
    """A request from ``submit`` until its decode instance admits it (or it fails)."""

    decode: int
    members: tuple[int, ...]  # every pool member of the plan
    pieces: dict[int, list[PieceRows]]  # member -> its pieces
    planned_s: float
    submitted: float
    landed: int = 0
    total: int = 0
    prefilled: int = 0
    done: bool = False  # in the decode instance's hands (or failed)


@dataclass
class Granted:
    """A piece granted (go) that its member's ranks have not all reported sent yet."""

    decode: int
    rows: int
    senders: int  # the member's ranks yet to report it
    slot: int  # the decode instance's transfer slot: the channel the piece travels on
    xfer: int  # the grant's number: its messages' labels
    unsent: bool = False  # a rank reported it could not send the KV


@dataclass
class TransferStats:
    """The hand-off's figures (§4.2), for stats and metrics."""

    prefills: int = 0
    prefill_seconds: float = 0.0
    planned_seconds: float = 0.0
    waits: int = 0
    wait_seconds: float = 0.0
    failed: int = 0
    streamed_layers: int = 0  # layerwise: piece-layers sent (per sending rank)
    streamed_early: int = 0  # of them, sent while their prefill still computed
    sent_mid_prefill: int = 0  # whole pieces whose sends started during a later prefill


@dataclass
class GroupState:
    """The controller's state of one group (see the module docstring)."""

    policy: TetrisPolicy
    procs: list[BaseProcess]  # this host's ranks, in rank order
    # Each prefill instance's ranks' links, in TP order (the first speaks for it).
    pool_conns: list[list[PoolLink]]
    decode_conns: list[DecodeLink]  # each decode instance's leader
    store: Store | None
    timeout_s: float
    deliver: Deliver
    row_bytes: int = 0
    max_model_len: int = 0
    ranks_per_node: int = 0  # 0: every rank on this host
    managers: list[ReceiveManager] = field(default_factory=list)
    transfer: TransferStats = field(default_factory=TransferStats)
    snapshots: list[Snapshot | None] = field(default_factory=list)
    dead_pool: dict[int, str] = field(default_factory=dict)  # instance -> why
    closed: bool = False
    dead: str | None = None
    requests: dict[str, RequestState] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)
    handshakes: list[queue.Queue[tuple[str, int]]] = field(default_factory=list)  # (rid, piece)
    threads: list[threading.Thread] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    granted: dict[tuple[int, str, int], Granted] = field(default_factory=dict)  # (m, rid, piece)
    xfers: itertools.count[int] = field(default_factory=itertools.count)  # grant numbers
    # Probe replies by probe id, then member: each chunk's seconds, or why it failed.
    probes: dict[str, dict[int, tuple[float, ...] | str]] = field(default_factory=dict)
    probe_done: threading.Condition = field(default_factory=threading.Condition)
    probe_lock: threading.Lock = field(default_factory=threading.Lock)  # one profile at a time

    @property
    def layerwise(self) -> bool:
        return bool(self.policy.message.layerwise_transfer)

    def node(self, rank: int) -> int:
        """The node (pod of the group) that runs global ``rank``."""
        return rank // self.ranks_per_node if self.ranks_per_node else 0

    # ---- links -------------------------------------------------------------------------------

    def send(self, link: Link[Out, Any], message: Out) -> None:
        """Send, ignoring a link that is gone (its loss is the reader's to report)."""
        with contextlib.suppress(OSError, BrokenPipeError):
            link.send(message)

    def to_pool(self, m: int, message: ToPool) -> None:
        """``message`` to every rank of prefill instance ``m``."""
        for link in self.pool_conns[m]:
            self.send(link, message)

    def all_links(self) -> list[Link[Any, Any]]:
        return [c for ranks in self.pool_conns for c in ranks] + list(self.decode_conns)

    # ---- requests ----------------------------------------------------------------------------

    def release(self, rid: str, req: RequestState) -> None:
        """Whatever ``rid`` holds: its handshakes, its pieces, its decode blocks."""
        self.managers[req.decode].abort(rid)
        for m in req.members:
            self.to_pool(m, Cancel(rid))
        self.send(self.decode_conns[req.decode], Abort(rid))

    def fail(self, rid: str, exc: BaseException) -> None:
        """End ``rid`` with ``exc`` (delivered), releasing what it holds; no-op if it ended."""
        with self.lock:
            req = self.requests.pop(rid, None)
            if req is None:
                return
            self.transfer.failed += 1
        self.release(rid, req)
        self.deliver(rid, exc)

    def die(self, why: str) -> None:
        """The group cannot serve: every request fails with ``why`` and every rank ends."""
        log.error("%s", why)
        self.dead = why
        with self.lock:
            rids = list(self.requests)
        for rid in rids:
            self.fail(rid, GroupFailure(why))
        self.kill()

    def kill(self) -> None:
        """End every rank of this host now; the other nodes' see their links close and exit."""
        self.closed = True
        self.stop.set()
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        stop_processes(self.procs, timeout=10)
        for link in self.all_links():
            link.close()
        self.store = None
