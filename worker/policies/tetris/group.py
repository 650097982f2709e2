"""A running Tetris group: its rank processes and the control that joins them (Tetris §3.2
topology, §4.1 CDSP execution, §4.2 hand-off with handshake).

Every rank is a process in one torch.distributed group whose store this (the calling) process
hosts, on node 0. The caller talks to each prefill instance and to each decode instance's leader
over a connection: a pipe for this host's ranks; the ranks of other nodes (``run_tetris_node``, a
follower pod's side) dial this process's control listener, whose address and key it publishes in
the store. This module is the caller's side (``TetrisGroup``) and the ranks' loops.

A request goes like this:

1. ``submit``: the plan (the router's, or one chunk over the whole pool) is checked; the chosen
   decode instance is told to expect the request (its engine checks it like any request and
   reserves the prompt's KV blocks); the decode instance's ``ReceiveManager`` (kept here, on its
   behalf) is announced the pieces; every member of the plan's last group gets the request, in
   one global order, so rings on shared members never cross.
2. A member runs the chunks it is in (``run_chunk_plan``); then it offers each piece of its rows
   (at most a transfer buffer each: "ready") and goes on with its next message. A handshake
   thread here asks the decode instance's manager for a slot per piece (granted in
   first-handshake order, bounded wait) and lets the member send ("go"); the member starts the
   piece's sends in the background and says "sent" (its next prefill overlaps the transfer,
   §4.2), and only then is the decode leader told to receive the piece in its next step, so a
   decode step never waits on a member that is still computing. With ``layerwise_transfer``
   every piece is handshaken when the request is submitted; a grant makes the decode ranks post
   the piece's receives at once and the member send each layer as its last chunk computes it;
   its "sent" makes the decode leader finish the receives in its next step.
3. The decode leader reports each landed piece (the slot frees); with the last one it admits the
   request into its running batch, and its outputs stream back through here.

Failure: a request fails alone when its plan cannot finish (a member died, a transfer timed out,
its decode instance refused it): its waiting handshakes are aborted, its reserved blocks freed.
A dead prefill instance is reported with a queue of ``DEAD_QUEUE_S`` so planners avoid it, and
plans that name it are refused; decode instances keep serving. A dead decode rank ends the group.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import math
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Listener, wait
from typing import Any

import torch
import torch.distributed as dist

from gearshift.v1 import worker_pb2
from gearshift.worker.config import EngineConfig
from gearshift.worker.engine.control import SHUTDOWN, STEP, ControlChannel
from gearshift.worker.engine.llm_engine import EngineStats, InstanceLoad
from gearshift.worker.engine.outputs import RequestOutput
from gearshift.worker.errors import GroupFailure, InvalidRequestError
from gearshift.worker.launch.group_config import GroupConfig
from gearshift.worker.launch.host import bind_rank_cores, die_with_parent, set_threads, usable_cores
from gearshift.worker.launch.leader import _check, _engine
from gearshift.worker.launch.processes import rank_context, start_rank, stop_processes
from gearshift.worker.launch.rank import device_for, group_backend, setup_rank
from gearshift.worker.launch.replica_rank import IDLE_WAIT_S, ReplicaExecutor
from gearshift.worker.policies.tetris.chunked_prefill import (
    PlannedChunk,
    check_plan,
    rows_after,
    run_chunk_plan,
)
from gearshift.worker.policies.tetris.handoff import (
    LayerStream,
    Sending,
    start_piece,
    stream_tag,
)
from gearshift.worker.policies.tetris.policy import TetrisPolicy
from gearshift.worker.policies.tetris.rebalance import Holding
from gearshift.worker.policies.tetris.transfer import ReceiveManager, TransferError
from gearshift.worker.sampling.params import SamplingParams

log = logging.getLogger(__name__)

DEAD_QUEUE_S = 1e9  # a dead prefill instance's reported queue: no planner picks it
MAX_PROFILE_POINTS = 4096  # per ProfileTetris call
Deliver = Callable[[str, RequestOutput | BaseException], None]


def pieces_of(rows: dict[int, int], row_bytes: int, buffer_bytes: int) -> dict[int, list[tuple]]:
    """Each member's rows cut into runs of at most ``buffer_bytes`` (one row at least): the
    pieces it hands over, each after its own handshake (§4.2: a backend's buffer bounds a
    transfer)."""
    per = max(1, buffer_bytes // max(1, row_bytes))
    return {
        m: [(start, min(per, n - start)) for start in range(0, n, per)]
        for m, n in rows.items()
        if n
    }


# ---- the rank processes ---------------------------------------------------------------------


def _pool_loop(state: Any, policy: TetrisPolicy, conn: Any, rank: int) -> None:
    """A prefill instance: runs each request's chunk plan when its "prefill" arrives, then
    offers its pieces ("ready", one per piece) and goes on with the next message; each granted
    piece ("go") is started in the background (``start_piece``) and reported "sent", so the
    member computes its next prefill while its KV is still leaving (§4.2).

    With ``layerwise_transfer`` there is no "ready": the group handshakes every piece when the
    request arrives, and a "go" (read between layers too, while a prefill computes) starts the
    piece's ``LayerStream``: each layer of the last chunk leaves as soon as it is computed. A
    granted piece is always sent whole, zeros if its prefill failed ("unsent"), since its
    decode ranks have posted the receives.

    Every rank of an instance of TP > 1 gets the same messages and runs the same plans on its
    head shard (its ring: the same TP rank of the other instances); its TP rank 0 speaks for
    the instance ("prefilled", "ready", "profiled"), and each rank reports its own share of a
    piece "sent"."""
    gear = state.model.gears[0]
    model, world = gear.model, state.model.extra["world"]
    pool = policy.pool_comm(rank, world)
    _, _, j = policy.role(rank)
    speaks = j == 0
    kv_heads = model.config.num_kv_heads
    scale = model.config.head_dim**-0.5
    layerwise = bool(policy.message.layerwise_transfer)
    layers = len(model.model.layers)
    row = (model.num_kv_heads, model.config.head_dim, next(model.parameters()).dtype)
    tp = (j, policy.prefill_tp)
    # Requests whose pieces are offered but not all granted: their rows, pieces and receivers.
    offered: dict[str, tuple[Holding, list[tuple[int, int]], tuple[int, ...]]] = {}
    streams: dict[str, LayerStream] = {}  # layerwise: requests with pieces still to send
    deferred: collections.deque[tuple] = collections.deque()  # read mid-prefill, not yet run
    sending: list[Sending] = []  # started pieces whose sends may still be in flight

    def stream_of(rid: str, mine: list[tuple[int, int]], receivers: tuple[int, ...]) -> None:
        if rid not in streams:
            streams[rid] = LayerStream(mine, receivers, world, tp, kv_heads, row, layers)

    def report(rid: str, stream: LayerStream, pieces: list[int]) -> None:
        for piece in pieces:
            grant = stream.grants[piece]
            sending.append(grant.sending)
            conn.send(("unsent" if stream.broken else "sent", rid, piece, grant.early, layers))
        if stream.settled:
            streams.pop(rid, None)

    def go(msg: tuple) -> None:
        _, rid, piece, tag, count, receivers = msg
        stream = streams.get(rid)
        if stream is None:  # its prefill failed and it settled: zeros, so nothing stays posted
            stream = LayerStream([(0, count)], receivers, world, tp, kv_heads, row, layers)
            stream.fail()
            report(rid, stream, [0] if stream.grant(0, tag).done else [])
            return
        grant = stream.grant(piece, tag)
        if grant.done:
            report(rid, stream, [piece])

    def cancel(rid: str) -> None:
        stream = streams.get(rid)
        if stream is not None:  # its granted pieces still go whole (the decode drops them)
            stream.cancelled = True
            if stream.settled:
                streams.pop(rid)

    def go_whole(msg: tuple, mid_prefill: bool = False) -> None:
        # A granted piece of a prefill that is done: its send starts in the background.
        _, rid, piece = msg
        held = offered.get(rid)
        if held is None:
            conn.send(("unsent", rid, piece))
            return
        holding, mine, receivers = held
        start, count = mine[piece]
        rows = Holding(holding.kv[start : start + count], holding.positions[start : start + count])
        try:
            sending.append(start_piece(rows, receivers, world, tp, kv_heads))
        except Exception as exc:  # noqa: BLE001 - a decode rank is gone: this request fails
            offered.pop(rid, None)
            conn.send(("failed", rid, f"prefill instance {rank}: {str(exc).splitlines()[0]}"))
            return
        conn.send(("sent", rid, piece, int(mid_prefill)))
        if piece == len(mine) - 1:  # granted in order: the last piece is on its way
            offered.pop(rid, None)

    def grants_between_layers() -> None:
        # Whole hand-off: the grants of pieces offered before this prefill start their sends
        # between its layers, so a piece does not wait for the next prefill to end (§4.2: the
        # transfer overlaps the next request's compute). Everything else waits for the prefill,
        # and so does a grant behind its request's cancel, to keep their order.
        while offered and conn.poll(0):
            msg = conn.recv()
            cancelled = any(m[0] == "cancel" and m[1] == msg[1] for m in deferred)
            if msg[0] == "go" and not cancelled:
                go_whole(msg, mid_prefill=True)
                continue
            deferred.append(msg)

    def between_layers(stream: LayerStream) -> Callable[[torch.Tensor], None]:
        def on_layer(kv: torch.Tensor) -> None:
            stream.add_layer(kv)
            while conn.poll(0):  # grants that came while this prefill computes
                msg = conn.recv()
                if msg[0] == "go":
                    go(msg)
                    continue
                if msg[0] == "prefill" and msg[4]:
                    stream_of(msg[1], msg[4], msg[5])
                deferred.append(msg)

        return on_layer

    while True:
        sending = [s for s in sending if not s.done()]
        msg = deferred.popleft() if deferred else conn.recv()
        kind = msg[0]
        if kind == "stop":
            return
        if kind == "cancel":
            offered.pop(msg[1], None)  # its granted pieces are sent (the decode side drops them)
            cancel(msg[1])
            continue
        if kind == "go" and layerwise:
            go(msg)
            continue
        if kind == "go":
            go_whole(msg)
            continue
        if kind == "profile":
            _profile_probe(
                model, pool, conn if speaks else None, msg, scale, model.config.vocab_size
            )
            continue
        if kind != "prefill":
            continue
        _, rid, ids, chunks, mine, receivers = msg
        stream = None
        if layerwise and mine:
            stream_of(rid, mine, receivers)
            stream = streams[rid]
        plan = [PlannedChunk(n, tuple(g)) for n, g in chunks]
        started = time.perf_counter()
        on_layer = between_layers(stream) if stream is not None else None
        poll = grants_between_layers if not layerwise else None
        try:
            result = run_chunk_plan(
                model, pool, plan, torch.tensor(ids, dtype=torch.int64), scale, None, on_layer, poll
            )
        except Exception as exc:  # noqa: BLE001 - a ring peer died or the plan broke: it fails
            if stream is not None:
                report(rid, stream, stream.fail())
            conn.send(("failed", rid, f"prefill instance {rank}: {str(exc).splitlines()[0]}"))
            continue
        if stream is not None:
            report(rid, stream, stream.finish(result.holding.positions))
        elif mine and not layerwise:
            offered[rid] = (result.holding, mine, receivers)
        if not speaks:
            continue
        conn.send(("prefilled", rid, time.perf_counter() - started))
        if not layerwise:
            for i in range(len(mine)):
                conn.send(("ready", rid, i))


def _profile_probe(
    model: Any, pool: Any, conn: Any | None, msg: tuple, scale: float, vocab: int
) -> None:
    """A ``TetrisGroup.profile`` point on this member: its chunk plan on a random prompt, each
    chunk timed (``run_chunk_plan``'s timings); nothing is kept or handed over. ``conn`` None:
    a TP rank other than the instance's first, which runs it without reporting."""
    _, pid, chunks, seed = msg
    plan = [PlannedChunk(n, tuple(g)) for n, g in chunks]
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (sum(c.length for c in plan),), generator=gen)
    timings: list[float] = []
    try:
        run_chunk_plan(model, pool, plan, ids, scale, timings)
    except Exception as exc:  # noqa: BLE001 - a ring peer died: the probe fails
        if conn is not None:
            conn.send(("profile-failed", pid, str(exc).splitlines()[0]))
        return
    if conn is not None:
        conn.send(("profiled", pid, timings))


def _decode_loop(engine: Any, policy: TetrisPolicy, conn: Any, block_size: int) -> None:
    admission = policy.admission
    assert admission is not None
    stopping = False
    while True:
        busy = engine.has_unfinished_requests() or admission.has_work
        while conn.poll(0 if busy else IDLE_WAIT_S):
            cmd = conn.recv()
            kind = cmd[0]
            if kind == "expect":
                _, rid, ids, params, pieces = cmd
                try:
                    engine.add_request(rid, ids, params)
                    admission.expect(rid, pieces)
                except InvalidRequestError as exc:
                    engine.abort_request(rid)
                    conn.send(("refused", rid, exc.field, exc.message))
            elif kind == "receive":
                admission.receive(*cmd[1:])
            elif kind == "post":
                admission.post(*cmd[1:])
            elif kind == "complete":
                admission.complete(*cmd[1:])
            elif kind == "abort":
                engine.abort_request(cmd[1])
                admission.abort(cmd[1])
            elif kind == "snapshot":
                conn.send(("snapshot", engine.stats(), admission.reserved_rows(), block_size))
            elif kind == "stop":
                stopping = True
            busy = engine.has_unfinished_requests() or admission.has_work
        if busy:
            for out in engine.step():
                conn.send(("out", out))
            landed, failed = admission.take_reports()
            for rid, piece in landed:
                conn.send(("landed", rid, piece))
            for rid, why in failed:
                engine.abort_request(rid)
                conn.send(("xfailed", rid, why))
            continue
        if stopping and not admission.incoming:
            return
        engine.keepalive()


def _follow(runner: Any, channel: ControlChannel) -> None:
    while True:
        kind, plan = channel.recv()
        if kind == SHUTDOWN:
            break
        if kind == STEP and plan is not None:
            runner.execute(plan)
    runner.flush()
    runner.shutdown()


def tetris_rank_main(
    config: EngineConfig,
    policy: TetrisPolicy,
    group: GroupConfig,
    rank: int,
    port: int,
    conn: Any,
    cores: Sequence[int],
) -> None:
    """One rank's process: a prefill instance, a decode instance's leader (its engine) or one
    of its other ranks."""
    die_with_parent()
    role, index, t = policy.role(rank)
    name = f"{role} {index}" + (f" rank {t}" if role == "decode" and policy.decode_tp > 1 else "")
    logging.basicConfig(level=logging.WARNING, format=f"{name} %(levelname)s %(name)s: %(message)s")
    world = policy.world_size
    set_threads(config, group, world)
    bind_rank_cores(config, group, world, rank % group.local_ranks(world), cores)
    try:
        store = group.join_store(world, port)
        if conn is None and (role == "prefill" or t == 0):
            conn = _dial(store, rank)  # a rank of another node: the endpoint is on node 0
        device = device_for(config, rank)
        timeout = timedelta(seconds=group.timeout_s)
        backend = group_backend(config, device)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
        state = setup_rank(config, policy, rank, device, timeout)
        control = policy.instance_control(rank, timeout)
        channel = (
            None
            if control is None
            else ControlChannel(control, keepalive_interval=min(5.0, group.timeout_s / 4))
        )
        if role == "prefill":
            conn.send(("ready", {"num_blocks": state.num_blocks}))
            _pool_loop(state, policy, conn, rank)
            conn.send(("closed", {}))
        elif t == 0:
            executor = ReplicaExecutor(state.runner, None, index, channel)
            engine = _engine(config, policy, state, executor)
            conn.send(
                ("ready", {"num_blocks": state.num_blocks, "max_model_len": engine.max_model_len})
            )
            _decode_loop(engine, policy, conn, config.block_size)
            leaked = engine.blocks.leaked_blocks()
            free = engine.blocks.num_free_blocks == engine.blocks.num_blocks
            engine.shutdown()
            posted = len(policy.hook.posted) if policy.hook is not None else 0
            report = {"leaked_blocks": len(leaked), "all_free": free, "posted_receives": posted}
            conn.send(("closed", report))
        else:
            assert channel is not None
            _follow(state.runner, channel)
        # No world barrier: a dead prefill instance must not keep the others from ending.
        os._exit(0)
    except Exception as exc:  # any failure ends this rank, loudly
        log.exception("%s failed", name)
        print(f"gearshift tetris group: {name} failed: {exc}", file=sys.stderr, flush=True)
        os._exit(1)


CONTROL_KEY = "tetris/control"  # in the group's store: "host port authkey-hex" of the listener


def _dial(store: Any, rank: int) -> Any:
    """This rank's control connection to the endpoint on node 0 (its listener's address and key
    come from the group's rendezvous store; ``store.get`` waits for them, bounded by the store's
    timeout)."""
    host, port, key = store.get(CONTROL_KEY).decode().split(" ")
    conn = Client((host, int(port)), authkey=bytes.fromhex(key))
    conn.send(("hello", rank))
    return conn


def run_tetris_node(config: EngineConfig, policy: TetrisPolicy, group: GroupConfig) -> int:
    """A non-leader pod of a Tetris group (``launch.run_node``): its ranks, until the group
    ends; each instance leader dials the endpoint's listener. The first failing exit code
    wins."""
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
        role, index, t = policy.role(rank)
        args = (config, policy, group, rank, group.group_port, None, cores)
        name = f"gs-{role[0]}{index}" + (f"r{t}" if t else "")
        procs.append(start_rank(ctx, tetris_rank_main, args, name))
    codes = []
    for proc in procs:
        proc.join()
        codes.append(proc.exitcode or 0)
    return next((c for c in codes if c), 0)


class _Listener:
    """Node 0's control listener for the other nodes' instance leaders: each dials it (with the
    key published in the store) and says which rank it is; accepted on a thread, bounded."""

    def __init__(self, store: Any, group: GroupConfig, ranks: list[int]) -> None:
        key = os.urandom(32)
        self.listener = Listener(("0.0.0.0", 0), authkey=key)
        port = self.listener.address[1]
        store.set(CONTROL_KEY, f"{group.group_addr} {port} {key.hex()}")
        self.want = set(ranks)
        self.conns: dict[int, Any] = {}
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
                hello = conn.recv() if conn.poll(30) else None
            except (EOFError, OSError):
                hello = None
            if hello and hello[0] == "hello" and hello[1] in self.want - set(self.conns):
                self.conns[int(hello[1])] = conn
            else:
                conn.close()
        self.done.set()

    def wait(self, timeout_s: float, alive: Callable[[], None]) -> dict[int, Any]:
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
            self.closing = True
            if self.thread.is_alive():  # blocked in accept(): a bare connection wakes it
                with (
                    contextlib.suppress(OSError),
                    socket.create_connection(("127.0.0.1", self.listener.address[1]), timeout=1),
                ):
                    pass
            self.thread.join(5)
            self.listener.close()


# ---- the caller's side ----------------------------------------------------------------------


@dataclass
class _Request:
    decode: int
    members: tuple[int, ...]  # every pool member of the plan
    pieces: dict[int, list[tuple]]  # member -> its pieces
    planned_s: float
    submitted: float
    landed: int = 0
    total: int = 0
    prefilled: int = 0
    done: bool = False  # in the decode instance's hands (or failed)


@dataclass
class _Granted:
    """A piece granted (go) that its member's ranks have not all reported sent yet."""

    decode: int
    rows: int
    senders: int  # the member's ranks yet to report it
    tag: int = 0  # a streamed piece's first tag (layerwise)
    unsent: bool = False  # a rank reported it could not send the KV


@dataclass
class TransferStats:
    """The hand-off's figures (§4.2), for stats and metrics."""

    prefills: int = 0
    prefill_seconds: float = 0.0
    planned_seconds: float = 0.0
    waits: int = 0
    wait_seconds: float = 0.0
    failed: int = 0
    streamed_layers: int = 0  # layerwise: piece-layers sent (per sending rank)
    streamed_early: int = 0  # of them, sent while their prefill still computed
    sent_mid_prefill: int = 0  # whole pieces whose sends started during a later prefill


@dataclass
class TetrisGroup:
    """The calling process's handle on a running Tetris group (see the module docstring)."""

    policy: TetrisPolicy
    procs: list[Any]
    # Each prefill instance's ranks' connections, in TP order (the first speaks for it).
    pool_conns: list[list[Any]]
    decode_conns: list[Any]
    store: Any
    timeout_s: float
    deliver: Deliver
    row_bytes: int = 0
    max_model_len: int = 0
    ranks_per_node: int = 0  # 0: every rank on this host
    managers: list[ReceiveManager] = field(default_factory=list)
    transfer: TransferStats = field(default_factory=TransferStats)
    snapshots: list[tuple[EngineStats, int, int] | None] = field(default_factory=list)
    dead_pool: dict[int, str] = field(default_factory=dict)
    closed: bool = False
    dead: str | None = None
    _requests: dict[str, _Request] = field(default_factory=dict)
    _lock: threading.RLock = field(default_factory=threading.RLock)
    _send_locks: dict[int, threading.Lock] = field(default_factory=dict)
    _handshakes: list[queue.Queue[Any]] = field(default_factory=list)
    _threads: list[threading.Thread] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _granted: dict[tuple[int, str, int], _Granted] = field(default_factory=dict)  # (m, rid, piece)
    _xfers: itertools.count[int] = field(default_factory=itertools.count)  # streamed grants
    _probes: dict[str, dict[int, Any]] = field(default_factory=dict)  # profile replies by member
    _probe_done: threading.Condition = field(default_factory=threading.Condition)
    _probe_lock: threading.Lock = field(default_factory=threading.Lock)  # one profile at a time

    @property
    def layerwise(self) -> bool:
        return bool(self.policy.message.layerwise_transfer)

    # ---- pipes --------------------------------------------------------------------------

    def _send(self, conn: Any, message: tuple[Any, ...]) -> None:
        lock = self._send_locks.setdefault(id(conn), threading.Lock())
        with lock, contextlib.suppress(OSError, BrokenPipeError):
            conn.send(message)

    def _to_pool(self, m: int, message: tuple[Any, ...]) -> None:
        for conn in self.pool_conns[m]:
            self._send(conn, message)

    def _all_conns(self) -> list[Any]:
        return [c for ranks in self.pool_conns for c in ranks] + list(self.decode_conns)

    def start_threads(self) -> None:
        self.managers = [
            ReceiveManager(int(self.policy.message.transfer_backends))
            for _ in range(self.policy.decode)
        ]
        self.snapshots = [None] * self.policy.decode
        self._handshakes = [queue.Queue() for _ in self.pool_conns]
        self._threads = [threading.Thread(target=self._read, name="tetris-reader", daemon=True)]
        self._threads += [
            threading.Thread(target=self._handshake, args=(m,), name=f"tetris-hs-{m}", daemon=True)
            for m in range(len(self.pool_conns))
        ]
        for thread in self._threads:
            thread.start()

    # ---- requests -----------------------------------------------------------------------

    def default_plan(self, prompt_tokens: int) -> worker_pb2.TetrisPlan:
        """No router plan: one chunk over every live prefill instance, the decode instance with
        the fewest requests (WorkerGenerateRequest.tetris_plan)."""
        live = [m for m in range(self.policy.prefill) if m not in self.dead_pool]
        with self._lock:
            load = [0] * self.policy.decode
            for req in self._requests.values():
                load[req.decode] += 1
        for d, snap in enumerate(self.snapshots):
            if snap is not None:
                load[d] += snap[0].num_running
        decode = min(range(self.policy.decode), key=load.__getitem__)
        plan = worker_pb2.TetrisPlan(decode_instance=decode)
        plan.chunks.add(num_tokens=prompt_tokens, prefill_instances=live)
        return plan

    def submit(
        self,
        rid: str,
        ids: list[int],
        params: SamplingParams,
        plan: worker_pb2.TetrisPlan | None,
    ) -> None:
        """Start a request (raises InvalidRequestError for a plan the group cannot run, or
        GroupFailure when the plan names a dead prefill instance); its outputs come through
        ``deliver``."""
        if self.closed:
            raise GroupFailure(self.dead or "the tetris group is shutting down")
        if params.prompt_logprobs is not None:
            raise InvalidRequestError(
                "prompt_logprobs",
                "prompt_logprobs: the tetris policy's prefill pool computes no prompt logits",
            )
        if not ids:
            raise InvalidRequestError("prompt", "prompt is empty")
        plan = plan if plan is not None else self.default_plan(len(ids))
        chunks = [PlannedChunk(c.num_tokens, tuple(c.prefill_instances)) for c in plan.chunks]
        try:
            check_plan(chunks, len(ids), self.policy.prefill)
        except ValueError as exc:
            raise InvalidRequestError("tetris_plan", f"tetris_plan: {exc}") from exc
        d = plan.decode_instance
        if d >= self.policy.decode:
            raise InvalidRequestError(
                "tetris_plan.decode_instance",
                f"tetris_plan.decode_instance {d}: this group has {self.policy.decode} decode "
                "instances, numbered from 0",
            )
        dead = sorted(set(chunks[-1].group) & set(self.dead_pool))
        if dead:
            raise GroupFailure(f"prefill instance {dead[0]} is down: {self.dead_pool[dead[0]]}")
        pieces = pieces_of(
            rows_after(chunks), self.row_bytes, int(self.policy.message.transfer_buffer_bytes)
        )
        req = _Request(d, chunks[-1].group, pieces, plan.planned_prefill_seconds, time.monotonic())
        req.total = sum(len(p) for p in pieces.values())
        with self._lock:
            if rid in self._requests:
                raise InvalidRequestError("request_id", f"request id {rid!r} is already running")
            self._requests[rid] = req
            self.managers[d].announce(rid, req.total, len(ids))
            receivers = tuple(self.policy.decode_ranks(d))
            self._send(self.decode_conns[d], ("expect", rid, ids, params, req.total))
            wire = [(c.length, c.group) for c in chunks]
            for m in req.members:  # in one global order: rings on shared members never cross
                self._to_pool(m, ("prefill", rid, ids, wire, pieces.get(m, []), receivers))
            if self.layerwise:  # the handshakes run while the pool computes (§4.2)
                for m, mine in pieces.items():
                    for i in range(len(mine)):
                        self._handshakes[m].put((rid, i))

    def profile(
        self,
        sizes: Sequence[int],
        histories: Sequence[int],
        lengths: Sequence[int],
        repeats: int,
        stop: threading.Event | None = None,
    ) -> list[tuple[int, int, int, float]]:
        """Time CDSP prefill on the running pool (Eq. (1)'s samples, §5.1): for every SP size
        and (history C, length L) point, ``repeats`` runs of a C-token chunk then an L-token
        chunk on the first ``sp`` live instances, in the pool's request order (live requests
        queue with the probes). Returns (sp, C, L, seconds of the L chunk on its slowest
        member). Raises InvalidRequestError naming the field for a grid the pool cannot run,
        GroupFailure when an instance fails meanwhile or ``stop`` is set (the caller went away;
        checked between points)."""
        live = [m for m in range(self.policy.prefill) if m not in self.dead_pool]
        sizes = list(sizes) or list(range(1, len(live) + 1))
        if min(sizes) < 1 or max(sizes) > len(live):
            raise InvalidRequestError(
                "sp_sizes", f"sp_sizes: between 1 and the {len(live)} live prefill instances"
            )
        if not lengths or min(lengths) < 1 or min(histories, default=0) < 0:
            raise InvalidRequestError("lengths", "lengths: at least one, each >= 1")
        if max(histories, default=0) + max(lengths) > self.max_model_len:
            raise InvalidRequestError(
                "lengths",
                f"lengths: history + length up to {max(histories, default=0) + max(lengths)} "
                f"exceeds the model's {self.max_model_len} positions",
            )
        count = len(sizes) * max(1, len(histories)) * len(lengths) * max(1, repeats)
        if count > MAX_PROFILE_POINTS:
            raise InvalidRequestError(
                "repeats",
                f"repeats: the grid has {count} points (sp_sizes x histories x lengths x "
                f"repeats); at most {MAX_PROFILE_POINTS}",
            )
        points = [(0, min(sizes), 0, min(lengths))]  # untimed warm-up
        points += [
            (r + 1, sp, c, n)
            for sp in sizes
            for c in histories
            for n in lengths
            for r in range(max(1, repeats))
        ]
        out = []
        with self._probe_lock:
            for seed, sp, c, n in points:
                if stop is not None and stop.is_set():
                    raise GroupFailure("tetris profile: stopped (the caller went away)")
                seconds = self._probe(live[:sp], c, n, seed)
                if seed:
                    out.append((sp, c, n, seconds))
        return out

    def _probe(self, members: list[int], history: int, length: int, seed: int) -> float:
        group = tuple(members)
        wire = ([(history, group)] if history else []) + [(length, group)]
        pid = f"profile-{time.monotonic_ns()}"
        with self._lock:  # in the pool's one request order
            for m in members:
                self._to_pool(m, ("profile", pid, wire, seed))
        deadline = time.monotonic() + self.timeout_s
        with self._probe_done:
            while len(self._probes.get(pid, {})) < len(members):
                dead = [m for m in members if m in self.dead_pool]
                if dead or self.closed or time.monotonic() > deadline:
                    self._probes.pop(pid, None)
                    why = self.dead_pool.get(dead[0], "") if dead else "timed out or closed"
                    raise GroupFailure(f"tetris profile on instances {members}: {why}")
                self._probe_done.wait(0.1)
            replies = self._probes.pop(pid)
        failed = [r for r in replies.values() if isinstance(r, str)]
        if failed:
            raise GroupFailure(f"tetris profile on instances {members}: {failed[0]}")
        return max(float(r[-1]) for r in replies.values())

    def abort(self, rid: str) -> bool:
        with self._lock:
            req = self._requests.pop(rid, None)
        if req is None:
            return False
        self._release(rid, req)
        return True

    def _release(self, rid: str, req: _Request) -> None:
        """Whatever ``rid`` holds: its handshakes, its pieces, its decode blocks."""
        self.managers[req.decode].abort(rid)
        for m in req.members:
            self._to_pool(m, ("cancel", rid))
        self._send(self.decode_conns[req.decode], ("abort", rid))

    def _fail(self, rid: str, exc: BaseException) -> None:
        with self._lock:
            req = self._requests.pop(rid, None)
        if req is None:
            return
        with self._lock:
            self.transfer.failed += 1
        self._release(rid, req)
        self.deliver(rid, exc)

    # ---- the threads --------------------------------------------------------------------

    def _handshake(self, m: int) -> None:
        """Pool member ``m``'s pieces: a slot from the decode instance's manager, then go."""
        while not self._stop.is_set():
            try:
                rid, piece = self._handshakes[m].get(timeout=0.2)
            except queue.Empty:
                continue
            with self._lock:
                req = self._requests.get(rid)
            if req is None:
                self._to_pool(m, ("cancel", rid))
                continue
            started = time.monotonic()
            try:
                self.managers[req.decode].acquire(rid, self.timeout_s)
            except TransferError as exc:
                self._to_pool(m, ("cancel", rid))
                self._fail(rid, GroupFailure(f"KV transfer: {exc}"))
                continue
            with self._lock:
                self.transfer.waits += 1
                self.transfer.wait_seconds += time.monotonic() - started
            _, count = req.pieces[m][piece]
            with self._lock:
                # Under the lock: an abort either came first (then no go) or comes after the go,
                # whose "sent" still makes the decode instance receive (and drop) the piece.
                if rid not in self._requests or m in self.dead_pool:
                    self.managers[req.decode].abort(rid)
                    self._to_pool(m, ("cancel", rid))
                    continue
                senders = len(self.pool_conns[m])
                if not self.layerwise:
                    self._granted[(m, rid, piece)] = _Granted(req.decode, count, senders)
                    self._to_pool(m, ("go", rid, piece))
                    continue
                # Streamed: the decode ranks post the piece's receives now, and the member
                # sends each layer as it is computed.
                tag = stream_tag(next(self._xfers))
                self._granted[(m, rid, piece)] = _Granted(req.decode, count, senders, tag)
                self._send(self.decode_conns[req.decode], ("post", rid, m, count, piece, tag))
                receivers = tuple(self.policy.decode_ranks(req.decode))
                self._to_pool(m, ("go", rid, piece, tag, count, receivers))

    def _read(self) -> None:
        conns = {
            id(c): ("pool", m, self.policy.prefill_ranks(m)[j])
            for m in range(len(self.pool_conns))
            for j, c in enumerate(self.pool_conns[m])
        }
        conns |= {
            id(c): ("decode", i, self.policy.decode_ranks(i)[0])
            for i, c in enumerate(self.decode_conns)
        }
        live = self._all_conns()
        next_stats = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_stats:
                next_stats = now + 0.25
                for decode in self.decode_conns:
                    self._send(decode, ("snapshot",))
            try:
                ready: list[Any] = wait(live, timeout=0.1)
            except OSError:
                ready = []
            for conn in ready:
                role, i, rank = conns[id(conn)]
                try:
                    while conn.poll():
                        msg = conn.recv()
                        if role == "pool":
                            self._from_pool(i, msg)
                        else:
                            self._from_decode(i, msg)
                except (EOFError, OSError):
                    live.remove(conn)
                    self._lost(role, i, rank, live)
            self._check_procs(live)

    def _from_pool(self, m: int, msg: tuple[Any, ...]) -> None:
        kind, rid = msg[0], str(msg[1])
        if kind == "ready":
            self._handshakes[m].put((rid, msg[2]))
        elif kind == "prefilled":
            with self._lock:
                req = self._requests.get(rid)
                if req is not None:
                    req.prefilled += 1
                    if req.prefilled == 1:
                        self.transfer.prefills += 1
                        self.transfer.prefill_seconds += msg[2]
                        self.transfer.planned_seconds += req.planned_s
        elif kind == "failed":
            self._fail(rid, GroupFailure(msg[2]))
        elif kind in ("sent", "unsent"):
            # The member started the piece's sends: only now is the decode instance told to
            # receive it (or, streamed, to finish receiving it), so its step never waits on a
            # member still computing.
            key = (m, rid, msg[2])
            with self._lock:
                if len(msg) > 4:  # a streamed piece's layers, and those sent mid-prefill
                    self.transfer.streamed_layers += msg[4]
                    self.transfer.streamed_early += msg[3]
                granted = self._granted.get(key)
                if granted is not None and kind == "unsent":
                    granted.unsent = True
                counting = kind == "sent" or self.layerwise  # streamed: every rank sends
                if granted is not None and counting and granted.senders > 1:
                    granted.senders -= 1  # another TP rank of the instance has yet to report
                    return
                self._granted.pop(key, None)
                if granted is not None and len(msg) == 4:  # a whole piece, its last sender
                    self.transfer.sent_mid_prefill += int(msg[3])
            if granted is None:
                return
            decode = self.decode_conns[granted.decode]
            if self.layerwise:
                self._send(decode, ("complete", rid, m, msg[2], granted.tag, int(granted.unsent)))
            elif kind == "sent":
                self._send(decode, ("receive", rid, m, granted.rows, msg[2]))
            if (
                granted.unsent or kind == "unsent"
            ):  # its prefill failed, or the member lost it: fail
                self._fail(rid, GroupFailure(f"prefill instance {m} could not send piece {msg[2]}"))
        elif kind in ("profiled", "profile-failed"):
            with self._probe_done:
                self._probes.setdefault(rid, {})[m] = msg[2]
                self._probe_done.notify_all()

    def _from_decode(self, d: int, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "out":
            out: RequestOutput = msg[1]
            if out.finished:
                with self._lock:
                    self._requests.pop(out.request_id, None)
            self.deliver(out.request_id, out)
        elif kind == "landed":
            rid = msg[1]
            with contextlib.suppress(KeyError, TransferError):
                self.managers[d].landed(rid)
            with self._lock:
                req = self._requests.get(rid)
                if req is not None:
                    req.landed += 1
                    req.done = req.landed == req.total
        elif kind == "refused":
            _, rid, fieldname, message = msg
            self._fail(rid, InvalidRequestError(fieldname, message))
        elif kind == "xfailed":
            self._fail(msg[1], GroupFailure(msg[2]))
        elif kind == "snapshot":
            self.snapshots[d] = (msg[1], msg[2], msg[3])

    def _lost(self, role: str, index: int, rank: int, live: list[Any]) -> None:
        """An instance's control connection closed: a rank of this host is reported by its
        exit (``_check_procs``); one of another node by this."""
        if self.closed or rank < len(self.procs):
            return
        role = "prefill" if role == "pool" else "decode"
        self._down(
            rank,
            f"{role} instance {index} (rank {rank}, another node) lost its control connection",
            live,
        )

    def _check_procs(self, live: list[Any]) -> None:
        if self.closed:
            return
        for rank, proc in enumerate(self.procs):
            if proc.is_alive():
                continue
            role, index, _ = self.policy.role(rank)
            self._down(
                rank,
                f"{role} instance {index} (rank {rank}) exited with code {proc.exitcode}",
                live,
            )
            if self.closed:
                return

    def _down(self, rank: int, why: str, live: list[Any]) -> None:
        """A rank is gone: a decode rank ends the group, a prefill instance fails its requests
        and is reported down."""
        role, index, _ = self.policy.role(rank)
        if role == "decode":
            self._die(f"tetris group: {why}; the group cannot serve without it")
            return
        if index not in self.dead_pool:
            log.error("%s", why)
            self.dead_pool[index] = why
            with self._lock:  # its granted pieces will never be sent (their requests fail)
                for key in [k for k in self._granted if k[0] == index]:
                    granted = self._granted.pop(key)
                    if self.layerwise:  # posted receives from a dead rank fail: drop them
                        m, rid, piece = key
                        complete = ("complete", rid, m, piece, granted.tag, 1)
                        self._send(self.decode_conns[granted.decode], complete)
            for conn in self.pool_conns[index]:
                with contextlib.suppress(ValueError):
                    live.remove(conn)
            with self._lock:
                hit = [
                    rid for rid, r in self._requests.items() if index in r.members and not r.done
                ]
            for rid in hit:
                self._fail(rid, GroupFailure(f"{why} during this request's prefill"))

    def _die(self, why: str) -> None:
        log.error("%s", why)
        self.dead = why
        with self._lock:
            rids = list(self._requests)
        for rid in rids:
            self._fail(rid, GroupFailure(why))
        self.kill()

    # ---- stats --------------------------------------------------------------------------

    def instances(self) -> list[InstanceLoad]:
        """The planner's view (§5.1–5.2): each prefill instance's queue T_k (the planned end of
        the requests it still has), each decode instance's KV room, reservations and batch."""
        now = time.monotonic()
        out = []
        with self._lock:
            reqs = list(self._requests.values())
        for m in range(self.policy.prefill):
            if m in self.dead_pool:
                queued = DEAD_QUEUE_S
            else:
                ends = [
                    r.submitted + r.planned_s - now
                    for r in reqs
                    if m in r.members and r.prefilled == 0
                ]
                queued = max([0.0, *ends])
            node = self._node(self.policy.prefill_ranks(m)[0])
            out.append(InstanceLoad("prefill", m, queued, 0, 0, 0, node))
        for d, snap in enumerate(self.snapshots):
            node = self._node(self.policy.decode_ranks(d)[0])
            if snap is None:
                out.append(InstanceLoad("decode", d, 0.0, 0, 0, 0, node))
                continue
            stats, reserved, block = snap
            # Slots not held by admitted requests (InstanceStats): the blocks reserved for
            # requests in transfer are reported apart, as virtual usage.
            free = (stats.kv_blocks_total - stats.kv_blocks_used) * block + reserved
            out.append(InstanceLoad("decode", d, 0.0, free, reserved, stats.num_running, node))
        return out

    def _node(self, rank: int) -> int:
        return rank // self.ranks_per_node if self.ranks_per_node else 0

    def stats(self) -> dict[str, float]:
        t = self.transfer
        waiting = sum(m.waiting_handshakes for m in self.managers)
        return {
            "prefills": float(t.prefills),
            "prefill_seconds_sum": t.prefill_seconds,
            "planned_prefill_seconds_sum": t.planned_seconds,
            "transfer_waits": float(t.waits),
            "transfer_wait_seconds_sum": t.wait_seconds,
            "handshake_queue": float(waiting),
            "transfer_slots_free": float(sum(m.free_slots for m in self.managers)),
            "requests_failed": float(t.failed),
            "prefill_instances_down": float(len(self.dead_pool)),
            "streamed_layers": float(t.streamed_layers),
            "streamed_layers_early": float(t.streamed_early),
            "pieces_sent_mid_prefill": float(t.sent_mid_prefill),
        }

    # ---- ending -------------------------------------------------------------------------

    def shutdown(self) -> list[dict[str, Any]]:
        """Stop every instance; what each decode instance reported about its KV blocks."""
        if self.closed:
            return []
        self._stop.set()
        for t in self._threads:
            t.join(5)
        reports = []
        for m in range(len(self.pool_conns)):
            if m not in self.dead_pool:
                self._to_pool(m, ("stop",))
        for conn in self.decode_conns:
            self._send(conn, ("stop",))
        deadline = time.monotonic() + self.timeout_s
        for conn in self.decode_conns:
            while time.monotonic() < deadline:
                try:
                    if conn.poll(0.05):
                        msg = conn.recv()
                        if msg[0] == "closed":
                            reports.append(msg[1])
                            break
                except (EOFError, OSError):
                    break
        self.closed = True
        stop_processes(self.procs, timeout=10)
        for conn in self._all_conns():
            conn.close()
        self.store = None
        return reports

    def kill(self) -> None:
        self.closed = True
        self._stop.set()
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        stop_processes(self.procs, timeout=10)
        for conn in self._all_conns():
            conn.close()  # the other nodes' instances see EOF and exit
        self.store = None


def start_tetris(
    config: EngineConfig, policy: TetrisPolicy, group: GroupConfig, deliver: Deliver
) -> TetrisGroup:
    """Spawn the group's ranks on this host and wait until each has loaded."""
    world = policy.world_size
    if torch.device(config.device).type != "cpu":
        # The pool's prompts, Holdings and hand-off buffers are host tensors: the NCCL path of
        # the ring and the hand-off is not built.
        raise InvalidRequestError(
            "device",
            f"the tetris policy runs on CPU (gloo) in this engine; device {config.device!r} is "
            "not supported yet",
        )
    _check(config, policy, group)
    if group.node_rank != 0:
        raise InvalidRequestError(
            "node_rank", "only node 0 hosts the tetris endpoint; other nodes run run_node"
        )
    store = group.host_store(world)
    port = int(store.port)
    ctx = rank_context()
    cores = usable_cores()
    local = group.local_ranks(world)
    # The other nodes' instance leaders dial node 0 (run_tetris_node): listen before they ask.
    remote = [
        r for r in range(local, world) if policy.role(r)[0] == "prefill" or not policy.role(r)[2]
    ]
    listener = _Listener(store, group, remote) if remote else None
    procs: list[Any] = []
    conns: dict[int, Any] = {}
    for rank in range(local):
        role, index, t = policy.role(rank)
        parent, child = ctx.Pipe() if role == "prefill" or t == 0 else (None, None)
        procs.append(
            start_rank(
                ctx,
                tetris_rank_main,
                (config, policy, group, rank, port, child, cores),
                f"gs-{role[0]}{index}" + (f"r{t}" if t else ""),
            )
        )
        if child is not None:
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
    pool_conns = [[conns[r] for r in policy.prefill_ranks(m)] for m in range(policy.prefill)]
    decode_conns = [conns[policy.decode_ranks(d)[0]] for d in range(policy.decode)]
    handle = TetrisGroup(policy, procs, pool_conns, decode_conns, store, group.timeout_s, deliver)
    handle.ranks_per_node = local
    try:
        ready = [_await_ready(handle, conn) for conn in handle._all_conns()]
    except BaseException:
        handle.kill()
        raise
    handle.max_model_len = int(ready[-1]["max_model_len"])
    from gearshift.worker.engine.loading import inspect_model

    spec, source = inspect_model(config, torch.device("cpu"))
    source.close()
    cfg = spec.config
    heads = math.ceil(cfg.num_kv_heads / policy.decode_tp)
    handle.row_bytes = cfg.num_layers * 2 * heads * cfg.head_dim * spec.dtype.itemsize
    handle.start_threads()
    return handle


def _await_ready(handle: TetrisGroup, conn: Any) -> dict[str, Any]:
    deadline = time.monotonic() + handle.timeout_s
    while time.monotonic() < deadline:
        try:
            if conn.poll(0.1):
                msg = conn.recv()
                if msg[0] == "ready":
                    return msg[1]
        except (EOFError, OSError) as exc:
            raise GroupFailure(
                "tetris group: an instance of another node closed its control connection while "
                "loading"
            ) from exc
        _loading(handle.procs)
    raise GroupFailure(f"tetris group: not loaded within {handle.timeout_s} s")


def _loading(procs: list[Any]) -> None:
    """GroupFailure naming a rank of this host that exited while the group was loading."""
    for rank, proc in enumerate(procs):
        if not proc.is_alive():
            raise GroupFailure(
                f"tetris group: rank {rank} exited with code {proc.exitcode} while loading"
            )
