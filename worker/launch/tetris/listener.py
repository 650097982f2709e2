"""Node 0's control listener: the other nodes' instance leaders of a Tetris group dial it and
the controller talks to them over those connections (Tetris §3.2: the pool and the decode
instances span nodes).

The listener's address and a fresh key go into the group's rendezvous store; a dialler must
know the key (``multiprocessing``'s HMAC challenge, no pickle) and then say ``Hello`` with its
rank. Everything that crosses these connections is one of the Tetris codecs' messages
(``messages.py``), so bytes that are not (a pickle, say) are refused: here the connection is
closed unread, later the controller treats the rank as lost.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener

from torch.distributed import Store

from gearshift.worker.errors import GroupFailure
from gearshift.worker.launch.group_config import GroupConfig
from gearshift.worker.launch.tetris.messages import HELLO, Hello
from gearshift.worker.wire import WireError

CONTROL_KEY = "tetris/control"  # in the group's store: "host port authkey-hex" of the listener
HELLO_WAIT_S = 30.0  # a dialler that says nothing this long is dropped
HELLO_BYTES = 4096  # a Hello is a few dozen bytes: anything longer is refused unread


def dial(store: Store, rank: int) -> Connection:
    """This rank's control connection to the controller on node 0, introduced (its listener's
    address and key come from the group's store; ``store.get`` waits for them, bounded by the
    store's timeout)."""
    host, port, key = store.get(CONTROL_KEY).decode().split(" ")
    conn = Client((host, int(port)), authkey=bytes.fromhex(key))
    HELLO.send(conn, Hello(rank))
    return conn


class ControlListener:
    """Accepts the wanted ranks' connections on a thread, bounded (see the module docstring)."""

    def __init__(self, store: Store, group: GroupConfig, ranks: list[int]) -> None:
        key = os.urandom(32)
        self.listener = Listener(("0.0.0.0", 0), authkey=key)
        self.port = int(self.listener.address[1])
        store.set(CONTROL_KEY, f"{group.group_addr} {self.port} {key.hex()}")
        self.want = set(ranks)
        self.conns: dict[int, Connection] = {}
        self.refused = 0  # connections closed for a bad or missing Hello
        self.closing = False
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._accept, name="tetris-listen", daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while self.want - set(self.conns) and not self.closing:
            try:
                conn = self.listener.accept()
            except (AuthenticationError, EOFError, ConnectionError):
                continue  # a caller without the key, or the close below poking accept()
            except OSError:
                break
            if self.closing:
                conn.close()
                break
            try:
                data = conn.recv_bytes(HELLO_BYTES) if conn.poll(HELLO_WAIT_S) else b""
                hello = HELLO.decode(data) if data else None
            except (EOFError, OSError, WireError):
                hello = None
            if hello is not None and hello.rank in self.want - set(self.conns):
                self.conns[hello.rank] = conn
            else:
                self.refused += 1
                conn.close()
        self.done.set()

    def wait(self, timeout_s: float, alive: Callable[[], None]) -> dict[int, Connection]:
        """Every wanted rank's connection (``alive`` raises when a local rank died meanwhile);
        GroupFailure after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        try:
            while not self.done.wait(0.1):
                alive()
                if time.monotonic() > deadline:
                    missing = sorted(self.want - set(self.conns))
                    raise GroupFailure(
                        f"tetris group: ranks {missing} of the other nodes did not connect "
                        f"within {timeout_s} s"
                    )
            missing = sorted(self.want - set(self.conns))
            if missing:
                raise GroupFailure(f"tetris group: the control listener closed before {missing}")
            return self.conns
        except BaseException:
            for conn in self.conns.values():
                conn.close()
            raise
        finally:
            self.close()

    def close(self) -> None:
        """Stop accepting (idempotent)."""
        self.closing = True
        if self.thread.is_alive():  # blocked in accept(): a bare connection wakes it
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=1),
            ):
                pass
        self.thread.join(5)
        self.listener.close()
