"""The watchdog holds a loading rank to the long startup timeout and a serving one to the short
heartbeat timeout (a starved rank that is still loading is not dead; a hung serving one is)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

from gearshift.worker.parallel.watchdog import Watchdog


def test_a_silent_peer_is_dead_only_once_it_has_loaded() -> None:
    master = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    verdicts: list[str] = []
    said = threading.Event()

    def on_failure(message: str) -> None:
        verdicts.append(message)
        said.set()

    leader = Watchdog("127.0.0.1", master.port, 0, 2, 0.05, 0.3, on_failure, startup_timeout=60.0)
    # Rank 1 joins (one heartbeat) and then never beats again: it is "loading", starved.
    follower = Watchdog("127.0.0.1", master.port, 1, 2, 0.05, 0.3, lambda m: None)
    leader.start()
    try:
        time.sleep(1.0)  # over three heartbeat timeouts of silence
        assert verdicts == [], "a loading rank was declared dead by the short timeout"
        follower.mark_ready()  # loaded: from now on it is held to 0.3 s, and it is silent
        assert said.wait(10), "a silent, loaded rank was never declared dead"
        assert verdicts[0].startswith("rank 1 stopped responding")
    finally:
        leader.stop()
