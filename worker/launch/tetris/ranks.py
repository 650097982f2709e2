"""One rank process of a Tetris group: a prefill instance's rank, a decode instance's leader
(its engine) or one of its other ranks (Tetris §3.2).

Every rank joins the group's one torch.distributed group through the store node 0 hosts. Ranks
of node 0 get a pipe to the controller from their parent; instance leaders of other nodes dial
its control listener (``listener.dial``).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from datetime import timedelta
from multiprocessing.connection import Connection

from gearshift.worker.config import EngineConfig
from gearshift.worker.engine.control import ControlChannel
from gearshift.worker.launch.group_config import GroupConfig
from gearshift.worker.launch.host import bind_rank_cores, die_with_parent, set_threads
from gearshift.worker.launch.leader import leader_engine
from gearshift.worker.launch.rank import (
    RankState,
    device_for,
    group_backend,
    init_process_group,
    setup_rank,
)
from gearshift.worker.launch.replica_rank import ReplicaExecutor
from gearshift.worker.launch.tetris.decode_rank import follow_decode_leader, run_decode_leader
from gearshift.worker.launch.tetris.links import LeaderLink, leader_link, member_link
from gearshift.worker.launch.tetris.listener import dial
from gearshift.worker.launch.tetris.messages import Closed, Loaded
from gearshift.worker.launch.tetris.pool_rank import PoolMember
from gearshift.worker.policies.tetris.policy import TetrisPolicy
from gearshift.worker.shm_segments import hard_exit

log = logging.getLogger(__name__)


def rank_name(policy: TetrisPolicy, rank: int) -> str:
    """The process name of global ``rank`` (``gs-p0``, ``gs-d1r1``: 15 bytes at most)."""
    role, index, t = policy.role(rank)
    return f"gs-{role[0]}{index}" + (f"r{t}" if t else "")


def speaks(policy: TetrisPolicy, rank: int) -> bool:
    """Whether ``rank`` has a link to the controller: every prefill rank, a decode leader."""
    role, _, t = policy.role(rank)
    return role == "prefill" or t == 0


def tetris_rank_main(
    config: EngineConfig,
    policy: TetrisPolicy,
    group: GroupConfig,
    rank: int,
    port: int,
    conn: Connection | None,
    cores: Sequence[int],
) -> None:
    """One rank's process (see the module docstring); ``conn``: its pipe to the controller on
    this host, None on another node (it dials)."""
    die_with_parent()
    role, index, t = policy.role(rank)
    name = f"{role} {index}" + (f" rank {t}" if role == "decode" and policy.decode_tp > 1 else "")
    logging.basicConfig(level=logging.WARNING, format=f"{name} %(levelname)s %(name)s: %(message)s")
    world = policy.world_size
    set_threads(config, group, world)
    bind_rank_cores(config, group, world, rank % group.local_ranks(world), cores)
    try:
        store = group.join_store(world, port)
        if conn is None and speaks(policy, rank):
            conn = dial(store, rank, group.control_token)  # another node's: the controller is on 0
        # cuda: local rank i on GPU i, over NCCL; cuda:N: every rank on GPU N, over gloo (NCCL
        # refuses two ranks on one device), device tensors staged through host memory.
        device = device_for(config, rank % group.local_ranks(world))
        timeout = timedelta(seconds=group.timeout_s)
        backend = group_backend(config, device)
        init_process_group(backend, store, rank, world, timeout, device)
        state = setup_rank(config, policy, rank, device, timeout)
        control = policy.instance_control(rank, timeout)
        channel = (
            None
            if control is None
            else ControlChannel(control, keepalive_interval=min(5.0, group.timeout_s / 4))
        )
        if conn is None:
            assert channel is not None
            follow_decode_leader(state.runner, channel)
        elif role == "prefill":
            link = member_link(conn)
            link.send(Loaded(state.num_blocks))
            PoolMember(state, policy, link, rank).run()
            link.send(Closed())
        else:
            _lead_decode(config, policy, state, leader_link(conn), index, channel)
        # No world barrier: a dead prefill instance must not keep the others from ending.
        hard_exit(0)
    except Exception as exc:  # any failure ends this rank, loudly
        log.exception("%s failed", name)
        print(f"gearshift tetris group: {name} failed: {exc}", file=sys.stderr, flush=True)
        hard_exit(1)


def _lead_decode(
    config: EngineConfig,
    policy: TetrisPolicy,
    state: RankState,
    link: LeaderLink,
    index: int,
    channel: ControlChannel | None,
) -> None:
    """A decode instance's leader: its engine, served over ``link`` until ``Stop``."""
    executor = ReplicaExecutor(state.runner, None, index, channel)
    engine = leader_engine(config, policy, state, executor)
    link.send(Loaded(state.num_blocks, engine.max_model_len))
    run_decode_leader(engine, policy, link, config.block_size)
    leaked = engine.blocks.leaked_blocks()
    free = engine.blocks.num_free_blocks == engine.blocks.num_blocks
    engine.shutdown()
    posted = len(policy.hook.posted) if policy.hook is not None else 0
    link.send(Closed(len(leaked), free, posted))
