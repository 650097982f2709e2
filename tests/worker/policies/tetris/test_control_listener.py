"""Node 0's control listener (launch/tetris/listener.py) over real loopback sockets: its key
comes from the control token, so a dialler that knows only what the rendezvous store holds is
refused; a dialler with the key that sends a pickle, or a Hello for a rank nobody waits for, is
refused and nothing is unpickled; the wanted ranks' links then carry the Tetris wire both ways.
Without a token (--insecure-no-auth) the store's nonce is the key, with a warning."""

from __future__ import annotations

import logging
from dataclasses import replace
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection
from pathlib import Path

import pytest
import torch.distributed as dist

from gearshift.worker.errors import GroupFailure
from gearshift.worker.launch.group_config import GroupConfig
from gearshift.worker.launch.tetris import messages as m
from gearshift.worker.launch.tetris.links import leader_link, member_link
from gearshift.worker.launch.tetris.listener import CONTROL_KEY, ControlListener, control_key, dial
from gearshift.worker.launch.tetris.messages import HELLO, TO_DECODE, Hello, Loaded, Stop
from tests.worker.policies.tetris.test_tetris_messages import live_pickle

WAIT_S = 30.0
TOKEN = "the-deployments-control-token"


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
    listener = ControlListener(store, GroupConfig(control_token=TOKEN), [2, 3])
    try:
        host, port, nonce = store.get(CONTROL_KEY).decode().split(" ")
        address = (host, int(port))
        key = control_key(TOKEN, bytes.fromhex(nonce))
        # What the unauthenticated store gives away is not the key, nor is another token's.
        for wrong in (b"not the key", bytes.fromhex(nonce), control_key("other", bytes(32))):
            with pytest.raises(AuthenticationError):
                Client(address, authkey=wrong)
        with pytest.raises(GroupFailure, match="do not hold the same control token"):
            dial(store, 2, "another-token")
        with pytest.raises(GroupFailure, match="do not hold the same control token"):
            dial(store, 2, None)  # a pod run --insecure-no-auth
        evil = Client(address, authkey=key)
        evil.send_bytes(payload)  # what Connection.send(obj) would write
        assert _refused(evil)
        assert not target.exists(), "the listener unpickled what it received"
        stranger = Client(address, authkey=key)
        stranger.send_bytes(HELLO.encode(Hello(7)))  # no such rank is waited for
        assert _refused(stranger)
        evil.close()
        stranger.close()
        two, three = member_link(dial(store, 2, TOKEN)), leader_link(dial(store, 3, TOKEN))
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


def test_without_a_token_the_stores_nonce_is_the_key_and_the_listener_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = dist.HashStore()
    with caplog.at_level(logging.WARNING, "gearshift.worker.launch.tetris.listener"):
        listener = ControlListener(store, replace(GroupConfig(), control_token=None), [1])
    try:
        assert "without a control token (--insecure-no-auth)" in caplog.text
        host, port, nonce = store.get(CONTROL_KEY).decode().split(" ")
        with pytest.raises(GroupFailure, match="do not hold the same control token"):
            dial(store, 1, TOKEN)  # a pod with a token does not dial an insecure one
        # Whoever reads the store can dial: its nonce is the key.
        raw = Client((host, int(port)), authkey=bytes.fromhex(nonce))
        HELLO.send(raw, Hello(1))
        link = member_link(raw)
        conns = listener.wait(WAIT_S, lambda: None)
        assert sorted(conns) == [1] and listener.refused == 0
        link.send(Loaded(4))
        assert m.FROM_POOL.recv(conns[1]) == Loaded(4)
        link.close()
        conns[1].close()
    finally:
        listener.close()
