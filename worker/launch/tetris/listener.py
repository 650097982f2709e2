"""Node 0's control listener: the other nodes' instance leaders of a Tetris group dial it and
the controller talks to them over those connections (Tetris §3.2: the pool and the decode
instances span nodes).

The listener's address and a fresh nonce go into the group's rendezvous store. The key is
HMAC-SHA256 of the nonce under the deployment's control token (``control_key``), which every
worker pod of the group has and the store never holds: reaching the store (it has no
authentication) is not enough to dial. A dialler must answer ``multiprocessing``'s HMAC challenge
for that key (no pickle) and then say ``Hello`` with its rank. Without a control token (only
with ``--insecure-no-auth``) the key is the nonce itself, as before, and the listener says so in
a warning. A token rotated between the starts of a group's pods fails that start (the dialler's
challenge is refused); the group starts again with the new token.

Everything that crosses these connections is one of the Tetris codecs' messages
(``messages.py``), so bytes that are not (a pickle, say) are refused: here the connection is
closed unread, later the controller treats the rank as lost. The key authenticates the dialler,
it does not encrypt: the NetworkPolicies keep the group's ports to the group's own pods.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
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

log = logging.getLogger(__name__)

CONTROL_KEY = "tetris/control"  # in the group's store: "host port nonce-hex" of the listener
KEY_LABEL = b"gearshift tetris control listener\x00"  # keys made for this use only
HELLO_WAIT_S = 30.0  # a dialler that says nothing this long is dropped
HELLO_BYTES = 4096  # a Hello is a few dozen bytes: anything longer is refused unread


def control_key(token: str | None, nonce: bytes) -> bytes:
    """The listener's HMAC key: the nonce signed with the control token; without a token
    (``--insecure-no-auth``) the nonce itself, which anyone reading the store knows."""
    if token is None:
        return nonce
    return hmac.new(token.encode(), KEY_LABEL + nonce, hashlib.sha256).digest()


def dial(store: Store, rank: int, token: str | None) -> Connection:
    """This rank's control connection to the controller on node 0, introduced (its listener's
    address and nonce come from the group's store; ``store.get`` waits for them, bounded by the
    store's timeout). ``token``: the deployment's control token, the one node 0 holds."""
    host, port, nonce = store.get(CONTROL_KEY).decode().split(" ")
    try:
        conn = Client((host, int(port)), authkey=control_key(token, bytes.fromhex(nonce)))
    except AuthenticationError as exc:
        raise GroupFailure(
            f"tetris group: rank {rank} was refused by node 0's control listener: the two pods "
            "do not hold the same control token"
        ) from exc
    HELLO.send(conn, Hello(rank))
    return conn


class ControlListener:
    """Accepts the wanted ranks' connections on a thread, bounded (see the module docstring)."""

    def __init__(self, store: Store, group: GroupConfig, ranks: list[int]) -> None:
        nonce = os.urandom(32)
        if group.control_token is None:
            log.warning(
                "tetris control listener without a control token (--insecure-no-auth): its key "
                "is in the group's rendezvous store, so whoever reaches the store can dial it"
            )
        key = control_key(group.control_token, nonce)
        self.listener = Listener(("0.0.0.0", 0), authkey=key)
        self.port = int(self.listener.address[1])
        store.set(CONTROL_KEY, f"{group.group_addr} {self.port} {nonce.hex()}")
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
