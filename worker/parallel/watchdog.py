"""Liveness of a worker group's ranks through heartbeats in the rendezvous store.

Every rank bumps its own counter each ``interval``; a rank whose counter stops moving for
``timeout`` is dead (``startup_timeout`` while it still loads: a loading rank starved of CPU may
miss a few beats, a serving one may not), and so is the store's host (rank 0) when the store
stops answering. A rank that fails on purpose records why (``exit/<rank>``) so its peers can
say it. On a verdict the watchdog reports the dead rank by number and ends this process: a rank
blocked in a collective cannot be woken any other way, and no rank may hang.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from gearshift.worker.shm_segments import hard_exit

log = logging.getLogger(__name__)

EXIT_PEER_FAILED = 3
LEADER_GONE = "rank 0 (the group leader, which hosts the rendezvous store) is unreachable"


def _default_on_failure(message: str) -> None:
    print(f"gearshift worker group: {message}", file=sys.stderr, flush=True)
    hard_exit(EXIT_PEER_FAILED)


class Watchdog:
    """Heartbeats for this rank; verdicts about the others."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        interval: float = 1.0,
        timeout: float = 15.0,
        on_failure: Callable[[str], None] = _default_on_failure,
        startup_timeout: float | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.interval = interval
        self.timeout = timeout
        self.startup_timeout = max(timeout, startup_timeout or timeout)
        self.on_failure = on_failure
        self._ready: set[int] = set()  # peers known to have finished loading
        # A client connection of its own: the process group's store is used by another thread.
        # Store calls may wait longer than a heartbeat timeout: a busy store host is not dead.
        store_timeout = timedelta(seconds=max(timeout, 15.0))
        self.store = dist.TCPStore(host, port, is_master=False, timeout=store_timeout)
        self.store.add(self._hb(rank), 1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watchdog-{rank}", daemon=True)
        self._seen: dict[int, tuple[int, float]] = {}

    @staticmethod
    def _hb(rank: int) -> str:
        return f"gearshift/hb/{rank}"

    @staticmethod
    def _ready_key(rank: int) -> str:
        return f"gearshift/ready/{rank}"

    def mark_ready(self) -> None:
        """This rank has loaded: from now on its peers hold it to ``timeout``."""
        self.store.set(self._ready_key(self.rank), "1")

    def _timeout_for(self, peer: int, timeout: float) -> float:
        if peer not in self._ready and self.store.check([self._ready_key(peer)]):
            self._ready.add(peer)
        return timeout if peer in self._ready else self.startup_timeout

    @staticmethod
    def _exit_key(rank: int) -> str:
        return f"gearshift/exit/{rank}"

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5 * self.interval)

    def record_exit(self, reason: str) -> None:
        """Tell the peers why this rank is about to stop."""
        try:
            self.store.set(self._exit_key(self.rank), reason)
        except Exception:  # the store may already be gone; peers time out instead
            log.debug("could not record exit reason", exc_info=True)

    def _peers(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.rank]

    def _verdict(self, now: float, timeout: float) -> str | None:
        """A message naming a dead rank, or None while everyone is alive."""
        for peer in self._peers():
            if self.store.check([self._exit_key(peer)]):
                reason = self.store.get(self._exit_key(peer)).decode(errors="replace")
                return f"rank {peer} exited: {reason}"
            count = self.store.add(self._hb(peer), 0)
            last = self._seen.get(peer)
            if last is None or last[0] != count:
                self._seen[peer] = (count, now)
            elif now - last[1] > self._timeout_for(peer, timeout):
                return f"rank {peer} stopped responding (no heartbeat for {now - last[1]:.0f} s)"
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.store.add(self._hb(self.rank), 1)
                message = self._verdict(time.monotonic(), self.timeout)
            except Exception as exc:  # noqa: BLE001 - any store failure means its host is gone
                message = f"{LEADER_GONE}: {exc}"
            if message is not None and not self._stop.is_set():
                self._stop.set()
                self.on_failure(f"{message}; rank {self.rank} is stopping")
                return

    def diagnose(self, wait: float | None = None) -> str:
        """After a failed collective: which rank died (the one whose heartbeat stood still)."""
        deadline = time.monotonic() + (wait if wait is not None else 3 * self.interval)
        try:
            before = {p: self.store.add(self._hb(p), 0) for p in self._peers()}
            while time.monotonic() < deadline:
                for peer in self._peers():
                    if self.store.check([self._exit_key(peer)]):
                        reason = self.store.get(self._exit_key(peer)).decode(errors="replace")
                        return f"rank {peer} exited: {reason}"
                time.sleep(self.interval / 2)
            stalled = [p for p in self._peers() if self.store.add(self._hb(p), 0) == before[p]]
        except Exception:  # noqa: BLE001
            return LEADER_GONE
        if stalled:
            return ", ".join(f"rank {p}" for p in stalled) + " stopped responding"
        return "a collective failed but every rank still has a heartbeat"
