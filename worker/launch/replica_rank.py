"""One rank of a replica group: a replica's leading rank runs its engine, driven over a pipe by
the process that hosts the group (``replicas.py``); a replica's other ranks (TP inside it) follow
its plans over the replica's own control channel.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch.distributed as dist

from gearshift.worker.comm import CommGroup
from gearshift.worker.config import EngineConfig
from gearshift.worker.engine.contract import IdleResult, ReplicaSync
from gearshift.worker.engine.control import SHUTDOWN, STEP, ControlChannel
from gearshift.worker.engine.executor import follow
from gearshift.worker.engine.model_runner import Done, ModelRunner, StepHandle
from gearshift.worker.engine.plan import StepPlan
from gearshift.worker.errors import GroupFailure, InvalidRequestError
from gearshift.worker.launch import replica_messages as msg
from gearshift.worker.launch.group_config import GroupConfig
from gearshift.worker.launch.host import bind_rank_cores, die_with_parent, set_threads
from gearshift.worker.launch.leader import leader_engine
from gearshift.worker.launch.rank import join_group
from gearshift.worker.parallel.watchdog import EXIT_PEER_FAILED
from gearshift.worker.policies.base import Policy
from gearshift.worker.shm_segments import hard_exit

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.005  # an idle replica's pause between polls of its pipe and its peers


@dataclass
class ReplicaExecutor:
    """A replica's executor: its peers agree on the step (``sync``), then its rank runs it."""

    runner: ModelRunner
    sync: ReplicaSync | None
    rank: int = 0  # the replica's index
    channel: ControlChannel | None = None  # to the replica's other ranks, if it has some

    def submit(self, plan: StepPlan) -> StepHandle:
        try:
            if self.sync is not None:
                self.sync.before_step(plan.num_tokens)
            if self.channel is not None:
                self.channel.send(STEP, plan)
            logits = self.runner.execute(plan)
        except RuntimeError as exc:
            if self.sync is None or "gloo" not in str(exc):
                raise
            # A peer is gone mid-step: the group is one failure domain.
            first = str(exc).splitlines()[0][-200:]
            raise GroupFailure(f"replica {self.rank}: a peer replica failed ({first})") from exc
        assert logits is not None
        return Done(logits)

    def keepalive(self) -> None:
        """Keep the replica's idle followers inside their receive timeout."""
        if self.channel is not None:
            self.channel.keepalive()

    def shutdown(self) -> None:
        if self.channel is not None:
            self.runner.flush()
            self.channel.send(SHUTDOWN)
        self.runner.shutdown()


def replica_channel(policy: Policy, rank: int, timeout_s: float) -> ControlChannel | None:
    """This rank's replica's control channel (None for one-rank replicas): every rank creates
    every replica's gloo group, in order (new_group is collective)."""
    n = policy.world_size // policy.engine_replicas()
    if n == 1:
        return None
    mine = None
    for r in range(policy.engine_replicas()):
        members = list(range(r * n, (r + 1) * n))
        pg = dist.new_group(members, backend="gloo", timeout=timedelta(seconds=timeout_s))
        if rank in members:
            mine = CommGroup(n, members.index(rank), tuple(members), pg)
    assert mine is not None
    return ControlChannel(mine, keepalive_interval=min(5.0, timeout_s / 4))


def _serve(
    engine: Any, sync: ReplicaSync | None, policy: Policy, conn: Connection, stream: bool = False
) -> None:
    """The replica's loop: commands from the pipe, steps, and idle boundaries. ``stream``: send
    every step's RequestOutput (``Output``, for a server) instead of finished token lists."""
    stopping = False
    tokens: dict[str, list[int]] = {}  # generated so far, per running request
    send = functools.partial(msg.FROM_REPLICA.send, conn)
    while True:
        busy = engine.has_unfinished_requests()
        while conn.poll(0 if busy or sync is not None else IDLE_WAIT_S):
            match command := msg.TO_REPLICA.recv(conn):
                case msg.AddRequest():
                    rid = command.request_id
                    try:
                        engine.add_request(rid, command.prompt_token_ids, command.params)
                    except InvalidRequestError as exc:
                        send(msg.Refused(rid, str(exc)))
                case msg.AbortRequest():
                    engine.abort_request(command.request_id)
                case msg.GetStats():
                    extra = json.dumps(sync.stats() if sync is not None else {})
                    send(msg.ReplicaStats(policy.stats(), extra, engine.stats()))
                case msg.GetSnapshot():  # a server's periodic stats (no mode tags)
                    send(msg.Snapshot(engine.stats()))
                case msg.StopReplica():
                    stopping = True
            busy = engine.has_unfinished_requests()
        if busy:
            for out in engine.step():
                if stream:
                    send(msg.Output(out))
                    continue
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finished:
                    reason = out.error or (out.finish_reason.value if out.finish_reason else "")
                    send(msg.Finished(out.request_id, tokens.pop(out.request_id), reason))
            continue
        if sync is None:
            if stopping:
                return
            continue
        engine.keepalive()
        result = sync.idle(stopping)
        if result is IdleResult.STOP:
            return
        if result is IdleResult.WAIT:
            time.sleep(IDLE_WAIT_S)


def replica_main(
    config: EngineConfig,
    policy: Policy,
    group: GroupConfig,
    rank: int,
    port: int,
    conn: Connection | None,
    cores: Sequence[int],
    stream: bool = False,
) -> None:
    """One rank's process: a replica's leading rank runs its engine, driven over ``conn``; any
    other rank (``conn`` None) follows its leader's plans."""
    die_with_parent()
    world = policy.world_size
    n = world // policy.engine_replicas()
    replica = rank // n
    name = f"replica {replica}" + (f" rank {rank}" if n > 1 else "")
    logging.basicConfig(level=logging.WARNING, format=f"{name} %(levelname)s %(name)s: %(message)s")
    set_threads(config, group, world)
    bind_rank_cores(config, group, world, rank, cores)
    try:
        store = group.join_store(world, port)
        state = join_group(config, policy, group, rank, store, port)
        channel = replica_channel(policy, rank, group.timeout_s)
        assert state.watchdog is not None
        if conn is None:
            assert channel is not None
            follow(state.runner, channel, state.watchdog)
            return
        send = None if channel is None else (lambda plan: channel.send(STEP, plan))
        sync = policy.replica_sync(store, send)
        executor = ReplicaExecutor(state.runner, sync, replica, channel)
        engine = leader_engine(config, policy, state, executor)
        msg.FROM_REPLICA.send(conn, msg.ReplicaReady(state.num_blocks, engine.max_model_len))
        _serve(engine, sync, policy, conn, stream)
        leaked = engine.blocks.leaked_blocks()
        free = engine.blocks.num_free_blocks == engine.blocks.num_blocks
        engine.shutdown()
        state.watchdog.stop()
        if channel is not None:
            dist.barrier(group=channel.group.group)  # the followers' close_group meets here
        dist.destroy_process_group()
        msg.FROM_REPLICA.send(conn, msg.Closed(len(leaked), free))
    except GroupFailure as exc:
        print(f"gearshift replica group: {exc}", file=sys.stderr, flush=True)
        hard_exit(EXIT_PEER_FAILED)
    except Exception as exc:  # any failure ends this replica, loudly
        log.exception("%s failed", name)
        print(f"gearshift replica group: {name} failed: {exc}", file=sys.stderr)
        hard_exit(1)
