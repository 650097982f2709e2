"""This host's follower ranks as child processes: spawn them, and make sure none outlives the
group."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.multiprocessing as mp

from gearshift.worker.config import EngineConfig
from gearshift.worker.launch.group_config import GroupConfig
from gearshift.worker.launch.host import usable_cores
from gearshift.worker.launch.rank import follower_main
from gearshift.worker.policies.base import Policy


def spawn_followers(
    config: EngineConfig,
    policy: Policy,
    group: GroupConfig,
    ranks: Sequence[int],
    port: int,
    orphan_guard: bool,
) -> list[Any]:
    ctx = mp.get_context("spawn")
    cores = usable_cores()  # before the leader pins itself: every rank splits the same set
    procs = []
    for rank in ranks:
        proc = ctx.Process(
            target=follower_main,
            args=(config, policy, group, rank, port, orphan_guard, cores),
            name=f"gearshift-rank-{rank}",
            daemon=True,
        )
        proc.start()
        procs.append(proc)
    return procs


def stop_processes(procs: list[Any], timeout: float = 30.0) -> None:
    """Wait for ranks to finish, then kill what is left; nothing outlives the group."""
    for proc in procs:
        proc.join(timeout)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
