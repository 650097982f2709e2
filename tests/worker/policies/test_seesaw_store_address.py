"""What Seesaw's rank 0 tells the other ranks about the host KV store (host_kv.StoreAddress, a
typed message over typed_collectives.broadcast_message, never broadcast_object_list): it
round-trips, a pickle is refused unloaded, and a name that is not this group's segment (a
path, another group's) or a page count out of range is refused before anything is opened."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gearshift.worker.errors import GroupFailure
from gearshift.worker.policies.seesaw.host_kv import (
    STORE_ADDRESS,
    StoreAddress,
    check_address,
    segment_name,
)
from gearshift.worker.wire import WireError
from tests.worker.policies.tetris.test_tetris_messages import live_pickle


def test_an_address_round_trips_and_passes_its_check() -> None:
    address = StoreAddress(segment_name("local"), 4096)
    back = STORE_ADDRESS.decode(STORE_ADDRESS.encode(address))
    assert back == address
    check_address(back, "local")


def test_a_pickle_is_refused_and_never_loaded(tmp_path: Path) -> None:
    payload, target = live_pickle(tmp_path)
    with pytest.raises(WireError, match="not a message"):
        STORE_ADDRESS.decode(payload)
    assert not target.exists()


@pytest.mark.parametrize(
    ("address", "words"),
    [
        (StoreAddress("../../etc/passwd", 4), "name refused: '../../etc/passwd'"),
        (StoreAddress(segment_name("other"), 4), "is not a segment of this group"),
        (StoreAddress(segment_name("local") + "/x", 4), "is not a segment of this group"),
        (StoreAddress("gearshift-sidp-local-1-0123456789ab-l0-t0", 4), "not a segment"),
        (StoreAddress(segment_name("local"), 0), "pages refused: 0"),
        (StoreAddress(segment_name("local"), -1), "pages refused: -1"),
    ],
)
def test_an_address_of_something_else_is_refused(address: StoreAddress, words: str) -> None:
    with pytest.raises(GroupFailure, match=re.escape(words)) as err:
        check_address(STORE_ADDRESS.decode(STORE_ADDRESS.encode(address)), "local")
    assert str(err.value).startswith("seesaw host KV store: rank 0's ")
