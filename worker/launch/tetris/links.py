"""The control connections of a Tetris group as typed links: each end sends one direction's
messages and receives the other's (``messages.py``'s codecs; ``send_bytes``/``recv_bytes``,
never pickle).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from typing import Any, Generic, TypeVar

from gearshift.worker.launch.tetris.messages import (
    FROM_DECODE,
    FROM_POOL,
    TO_DECODE,
    TO_POOL,
    FromDecode,
    FromPool,
    ToDecode,
    ToPool,
)
from gearshift.worker.wire import Codec

Out = TypeVar("Out")
In = TypeVar("In")


class Link(Generic[Out, In]):
    """One end of a control connection; ``send`` may be called from several threads."""

    def __init__(
        self,
        conn: Connection,
        out: Codec[Out],
        into: Codec[In],
        max_bytes: int | None = None,
    ) -> None:
        """``max_bytes``: a longer message received is refused (OSError) unread."""
        self.conn = conn
        self.out = out
        self.into = into
        self.max_bytes = max_bytes
        self._lock = threading.Lock()

    def send(self, message: Out) -> None:
        data = self.out.encode(message)
        with self._lock:
            self.conn.send_bytes(data)

    def recv(self) -> In:
        """The next message (blocks); WireError for bytes that are not one of ``into``'s."""
        return self.into.decode(self.conn.recv_bytes(self.max_bytes))

    def poll(self, timeout: float | None = 0.0) -> bool:
        return self.conn.poll(timeout)

    def close(self) -> None:
        self.conn.close()


PoolLink = Link[ToPool, FromPool]  # the controller's end of a prefill rank's connection
DecodeLink = Link[ToDecode, FromDecode]  # the controller's end of a decode leader's
MemberLink = Link[FromPool, ToPool]  # a prefill rank's end
LeaderLink = Link[FromDecode, ToDecode]  # a decode leader's end


def pool_link(conn: Connection) -> PoolLink:
    return Link(conn, TO_POOL, FROM_POOL)


def decode_link(conn: Connection) -> DecodeLink:
    return Link(conn, TO_DECODE, FROM_DECODE)


def member_link(conn: Connection) -> MemberLink:
    return Link(conn, FROM_POOL, TO_POOL)


def leader_link(conn: Connection) -> LeaderLink:
    return Link(conn, FROM_DECODE, TO_DECODE)


def wait_links(links: Sequence[Link[Any, Any]], timeout: float) -> list[Link[Any, Any]]:
    """The links with something to read (or closed), waiting at most ``timeout`` seconds."""
    by_conn = {id(link.conn): link for link in links}
    return [by_conn[id(c)] for c in wait([link.conn for link in links], timeout)]
