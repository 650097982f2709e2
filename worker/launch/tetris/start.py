"""Starting a Tetris group: node 0 spawns its ranks, listens for the other nodes' instance
leaders and returns the controller once every rank has loaded (``start_tetris``); a follower
pod runs its node's ranks until the group ends (``run_tetris_node``).
"""

from __future__ import annotations

import math
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from gearshift.worker.config import EngineConfig
from gearshift.worker.engine.loading import inspect_model
from gearshift.worker.errors import GroupFailure, InvalidRequestError
from gearshift.worker.launch.group_config import GroupConfig
from gearshift.worker.launch.host import usable_cores
from gearshift.worker.launch.leader import check_group
from gearshift.worker.launch.processes import rank_context, start_rank, stop_processes
from gearshift.worker.launch.rank import check_comm_rules, gpu_index
from gearshift.worker.launch.tetris.controller import TetrisGroup
from gearshift.worker.launch.tetris.links import Link, decode_link, pool_link
from gearshift.worker.launch.tetris.listener import ControlListener
from gearshift.worker.launch.tetris.messages import Loaded
from gearshift.worker.launch.tetris.ranks import rank_name, speaks, tetris_rank_main
from gearshift.worker.launch.tetris.state import Deliver
from gearshift.worker.policies.base import Policy
from gearshift.worker.policies.tetris.policy import TetrisPolicy
from gearshift.worker.wire import WireError

LOAD_POLL_S = 0.1  # between looks at a loading rank's link and this host's processes


def start_tetris(
    config: EngineConfig, policy: TetrisPolicy, group: GroupConfig, deliver: Deliver
) -> TetrisGroup:
    """Spawn the group's ranks on this host and wait until each has loaded."""
    world = policy.world_size
    check_comm_rules()
    check_group(config, policy, group)
    for local_rank in range(group.local_ranks(world)):  # before any rank starts
        gpu_index(config, local_rank)
    if group.node_rank != 0:
        raise InvalidRequestError(
            "node_rank", "only node 0 hosts the tetris endpoint; other nodes run run_node"
        )
    store = group.host_store(world)
    port = int(store.port)
    ctx = rank_context()
    cores = usable_cores()
    local = group.local_ranks(world)
    # The other nodes' instance leaders dial node 0 (listener.dial): listen before they ask.
    remote = [r for r in range(local, world) if speaks(policy, r)]
    listener = ControlListener(store, group, remote) if remote else None
    procs: list[BaseProcess] = []
    conns: dict[int, Connection] = {}
    for rank in range(local):
        parent: Connection | None = None
        child: Connection | None = None
        if speaks(policy, rank):
            parent, child = ctx.Pipe()
        args = (config, policy, group, rank, port, child, cores)
        procs.append(start_rank(ctx, tetris_rank_main, args, rank_name(policy, rank)))
        if child is not None and parent is not None:
            child.close()
            conns[rank] = parent
    try:
        if listener is not None:
            conns |= listener.wait(group.timeout_s, lambda: _loading(procs))
    except BaseException:
        for conn in conns.values():
            conn.close()
        for proc in procs:
            proc.kill()
        stop_processes(procs, timeout=10)
        raise
    pool = [[pool_link(conns[r]) for r in policy.prefill_ranks(m)] for m in range(policy.prefill)]
    decode = [decode_link(conns[policy.decode_ranks(d)[0]]) for d in range(policy.decode)]
    handle = TetrisGroup(policy, procs, pool, decode, store, group.timeout_s, deliver)
    handle.ranks_per_node = local
    try:
        ready = [_await_loaded(handle, link) for link in handle.all_links()]
    except BaseException:
        handle.kill()
        raise
    handle.max_model_len = ready[-1].max_model_len  # the last link is a decode leader's
    spec, source = inspect_model(config, torch.device("cpu"))
    source.close()
    cfg = spec.config
    heads = math.ceil(cfg.num_kv_heads / policy.decode_tp)
    handle.row_bytes = cfg.num_layers * 2 * heads * cfg.head_dim * spec.dtype.itemsize
    handle.start_threads()
    return handle


def _await_loaded(handle: TetrisGroup, link: Link[Any, Any]) -> Loaded:
    deadline = time.monotonic() + handle.timeout_s
    while time.monotonic() < deadline:
        try:
            if link.poll(LOAD_POLL_S):
                msg = link.recv()
                if isinstance(msg, Loaded):
                    return msg
        except (EOFError, OSError, WireError) as exc:
            raise GroupFailure(
                "tetris group: an instance of another node closed its control connection while "
                "loading"
            ) from exc
        _loading(handle.procs)
    raise GroupFailure(f"tetris group: not loaded within {handle.timeout_s} s")


def _loading(procs: list[BaseProcess]) -> None:
    """GroupFailure naming a rank of this host that exited while the group was loading."""
    for rank, proc in enumerate(procs):
        if not proc.is_alive():
            raise GroupFailure(
                f"tetris group: rank {rank} exited with code {proc.exitcode} while loading"
            )


def run_tetris_node(config: EngineConfig, policy: Policy, group: GroupConfig) -> int:
    """A non-leader pod of a Tetris group: its ranks, until the group ends; each instance
    leader dials node 0's listener. The first failing exit code wins."""
    if not isinstance(policy, TetrisPolicy):
        raise InvalidRequestError(
            f"policy.{policy.kind}",
            f"the tetris group runtime runs the tetris policy, not {policy.kind}",
        )
    world = policy.world_size
    local = group.local_ranks(world)
    first = group.node_rank * local
    if group.node_rank < 1 or first + local > world:
        raise InvalidRequestError(
            "node_rank", f"node {group.node_rank} of {local} ranks has no ranks in {world}"
        )
    ctx = rank_context()
    cores = usable_cores()
    procs = []
    for rank in range(first, first + local):
        args = (config, policy, group, rank, group.group_port, None, cores)
        procs.append(start_rank(ctx, tetris_rank_main, args, rank_name(policy, rank)))
    codes = []
    for proc in procs:
        proc.join()
        codes.append(proc.exitcode or 0)
    return next((c for c in codes if c), 0)
