"""The receiving half of the NCCL rules on gloo: each receive's header is checked before its
payload's receive is posted.

A receive first posts the header's receive. A thread per sending peer takes that peer's
receives in posting order, waits for each header (gloo's own timeout bounds the wait, and a dead
peer fails it at once), checks it (``Header.mismatch``) and only then posts the payload's
receive, so the payload lands as soon as it arrives, as under NCCL, where every receive is posted
when it is called. The thread exits when its peer has no receive left, so an idle channel holds no
thread.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gearshift.worker.p2p.header import HEADER_BYTES, Header
from gearshift.worker.p2p.rules import COMM_RULES_ENV, RuleViolation


def first_line(exc: BaseException) -> str:
    """What happened, in one short line: gloo's messages start with a source path and end with
    advice ("[.../pair.cc:553] Connection closed by peer [ip]:port. This is typically ...")."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". This is typically")[0][:240]


@dataclass
class Incoming:
    """One checked receive: its header on the way, then its payload."""

    receiver: int  # this rank (global)
    seq: int
    buffer: torch.Tensor  # where the payload lands (host memory when gloo stages it)
    label: str
    header: torch.Tensor = field(
        default_factory=lambda: torch.empty(HEADER_BYTES, dtype=torch.uint8)
    )
    header_work: Any = None
    payload_work: Any = None
    ready: threading.Event = field(default_factory=threading.Event)
    violation: str | None = None  # the header does not fit this receive
    failure: str | None = None  # the header never came (the peer is gone)

    def check(self, sender: int) -> bool:
        """Wait for the header and compare it; False (with the reason kept) when it fails."""
        try:
            self.header_work.wait()
            got = Header.decode(self.header)
        except RuntimeError as exc:
            self.failure = f"rank {sender} is gone or silent ({first_line(exc)})"
            return False
        except ValueError as exc:
            self.violation = f"rank {sender}: {exc}"
            return False
        why = got.mismatch(
            self.receiver, self.seq, tuple(self.buffer.shape), self.buffer.dtype, self.label
        )
        if why is not None:
            self.violation = why
            return False
        return True

    def raise_if_failed(self, channel: str) -> None:
        if self.violation is not None:
            raise RuleViolation(f"{COMM_RULES_ENV}=nccl, channel {channel}: {self.violation}")
        if self.failure is not None:
            raise RuntimeError(self.failure)


class PeerReceiver:
    """Checks one sending peer's headers in posting order and posts their payloads."""

    def __init__(self, sender: int, post_payload: Callable[[Incoming], Any]) -> None:
        self.sender = sender  # global rank
        self._post = post_payload
        self._queue: deque[Incoming] = deque()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        # After a receive failed, the peer's later payloads would pair with the one never
        # received: every later receive from it fails too.
        self._broken: str | None = None

    def add(self, incoming: Incoming) -> None:
        with self._lock:
            self._queue.append(incoming)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"p2p-check-from-{self.sender}", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._thread = None
                    return
                incoming = self._queue.popleft()
            if self._broken is not None:
                incoming.failure = self._broken
            elif incoming.check(self.sender):
                try:
                    incoming.payload_work = self._post(incoming)
                except RuntimeError as exc:
                    incoming.failure = f"rank {self.sender}: {first_line(exc)}"
            if incoming.failure is not None or incoming.violation is not None:
                self._broken = self._broken or (
                    f"an earlier receive #{incoming.seq} from rank {self.sender} failed: "
                    f"{incoming.violation or incoming.failure}"
                )
            incoming.ready.set()
