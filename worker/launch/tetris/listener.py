"""Node 0's control listener: the other nodes' instance leaders of a Tetris group dial it and
the controller talks to them over those connections (Tetris §3.2: the pool and the decode
instances span nodes).

The listener's address and a fresh key go into the group's rendezvous store; a dialler must
know the key (``multiprocessing``'s HMAC challenge, no pickle) and then say ``Hello`` with its
rank. Everything that crosses these connections is the Tetris wire (``messages.WIRE``), so bytes
that are not one of its messages (a pickle, say) are refused and the connection closed.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Listener

from torch.distributed import Store

from gearshift.worker.errors import GroupFailure
from gearshift.worker.launch.group_config import GroupConfig
from gearshift.worker.launch.tetris.messages import WIRE, Hello
from gearshift.worker.wire import Link, WireError

CONTROL_KEY = "tetris/control"  # in the group's store: "host port authkey-hex" of the listener
HELLO_WAIT_S = 30.0  # a dialler that says nothing this long is dropped
HELLO_BYTES = 4096  # a Hello is a few dozen bytes: anything longer is refused unread


def dial(store: Store, rank: int) -> Link:
    """This rank's control link to the controller on node 0 (its listener's address and key
    come from the group's store; ``store.get`` waits for them, bounded by the store's
    timeout)."""
    host, port, key = store.get(CONTROL_KEY).decode().split(" ")
    link = Link(Client((host, int(port)), authkey=bytes.fromhex(key)), WIRE)
    link.send(Hello(rank))
    return link


class ControlListener:
    """Accepts the wanted ranks' connections on a thread, bounded (see the module docstring)."""

    def __init__(self, store: Store, group: GroupConfig, ranks: list[int]) -> None:
        key = os.urandom(32)
        self.listener = Listener(("0.0.0.0", 0), authkey=key)
        self.port = int(self.listener.address[1])
        store.set(CONTROL_KEY, f"{group.group_addr} {self.port} {key.hex()}")
        self.want = set(ranks)
        self.links: dict[int, Link] = {}
        self.refused = 0  # connections closed for a bad or missing Hello
        self.closing = False
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._accept, name="tetris-listen", daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while self.want - set(self.links) and not self.closing:
            try:
                conn = self.listener.accept()
            except (AuthenticationError, EOFError, ConnectionError):
                continue  # a caller without the key, or the close below poking accept()
            except OSError:
                break
            if self.closing:
                conn.close()
                break
            link = Link(conn, WIRE, max_bytes=HELLO_BYTES)
            try:
                hello = link.recv() if link.poll(HELLO_WAIT_S) else None
            except (EOFError, OSError, WireError):
                hello = None
            if isinstance(hello, Hello) and hello.rank in self.want - set(self.links):
                link.max_bytes = None
                self.links[hello.rank] = link
            else:
                self.refused += 1
                link.close()
        self.done.set()

    def wait(self, timeout_s: float, alive: Callable[[], None]) -> dict[int, Link]:
        """Every wanted rank's link (``alive`` raises when a local rank died meanwhile);
        GroupFailure after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        try:
            while not self.done.wait(0.1):
                alive()
                if time.monotonic() > deadline:
                    missing = sorted(self.want - set(self.links))
                    raise GroupFailure(
                        f"tetris group: ranks {missing} of the other nodes did not connect "
                        f"within {timeout_s} s"
                    )
            missing = sorted(self.want - set(self.links))
            if missing:
                raise GroupFailure(f"tetris group: the control listener closed before {missing}")
            return self.links
        except BaseException:
            for link in self.links.values():
                link.close()
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
