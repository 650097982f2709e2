"""Node 0's control listener (launch/tetris/listener.py) over real loopback sockets: a dialler
with the key that sends a pickle, or a Hello for a rank nobody waits for, is refused and
nothing is unpickled; the wanted ranks' links then carry the Tetris wire both ways."""

from __future__ import annotations

from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection
from pathlib import Path

import pytest
import torch.distributed as dist

from gearshift.worker.errors import GroupFailure
from gearshift.worker.launch.group_config import GroupConfig
from gearshift.worker.launch.tetris import messages as m
from gearshift.worker.launch.tetris.links import leader_link, member_link
from gearshift.worker.launch.tetris.listener import CONTROL_KEY, ControlListener, dial
from gearshift.worker.launch.tetris.messages import HELLO, TO_DECODE, Hello, Loaded, Stop
from tests.worker.policies.tetris.test_tetris_messages import live_pickle

WAIT_S = 30.0


def _refused(conn: Connection) -> bool:
    """Whether the listener closed ``conn`` (bounded wait)."""
    if not conn.poll(WAIT_S):
        return False
    try:
        conn.recv_bytes()
    except (EOFError, OSError):
        return True
    return False


def test_the_listener_refuses_pickles_and_strangers_and_links_the_wanted_ranks(
    tmp_path: Path,
) -> None:
    payload, target = live_pickle(tmp_path)
    store = dist.HashStore()
    listener = ControlListener(store, GroupConfig(), [2, 3])
    try:
        host, port, key = store.get(CONTROL_KEY).decode().split(" ")
        address = (host, int(port))
        with pytest.raises(AuthenticationError):
            Client(address, authkey=b"not the key")
        evil = Client(address, authkey=bytes.fromhex(key))
        evil.send_bytes(payload)  # what Connection.send(obj) would write
        assert _refused(evil)
        assert not target.exists(), "the listener unpickled what it received"
        stranger = Client(address, authkey=bytes.fromhex(key))
        stranger.send_bytes(HELLO.encode(Hello(7)))  # no such rank is waited for
        assert _refused(stranger)
        evil.close()
        stranger.close()
        two, three = member_link(dial(store, 2)), leader_link(dial(store, 3))
        conns = listener.wait(WAIT_S, lambda: None)
        assert sorted(conns) == [2, 3] and listener.refused == 2
        TO_DECODE.send(conns[3], Stop())
        assert three.recv() == Stop()
        two.send(Loaded(16))
        assert m.FROM_POOL.recv(conns[2]) == Loaded(16)
        for link in [two, three]:
            link.close()
        for conn in conns.values():
            conn.close()
    finally:
        listener.close()


def test_ranks_that_never_dial_fail_the_start_within_the_timeout() -> None:
    store = dist.HashStore()
    listener = ControlListener(store, GroupConfig(), [1])
    with pytest.raises(GroupFailure, match=r"ranks \[1\] of the other nodes did not connect"):
        listener.wait(0.5, lambda: None)
    assert not listener.thread.is_alive()
