"""The engine in a child process, driven from the gRPC process's event loop over a pipe.

Like vLLM's engine core: the forward pass and the gRPC/protobuf work run in separate
interpreters, so neither waits for the other's GIL. The child runs the same EngineLoop; each
step's outputs cross the pipe as one message, with the latest stats. The messages are the
dataclasses of ``engine_messages.py``, encoded without pickle (``worker/wire.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import itertools
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

from google.protobuf.message import Message

from gearshift.v1 import policy_pb2, worker_pb2
from gearshift.worker.engine.contract import LiveValue
from gearshift.worker.engine.llm_engine import EngineStats
from gearshift.worker.engine.outputs import RequestOutput
from gearshift.worker.errors import GearshiftError, GroupFailure, InvalidRequestError
from gearshift.worker.launch.processes import (
    rank_context,
    set_process_name,
    start_in_environment,
)
from gearshift.worker.sampling.params import InvalidSamplingParams, SamplingParams
from gearshift.worker.server import engine_messages as msg
from gearshift.worker.server.engine_loop import EngineFailure, EngineStopped, OutputSink
from gearshift.worker.server.settings import WorkerSettings
from gearshift.worker.wire import WireError

log = logging.getLogger(__name__)
STATS_INTERVAL_S = 0.25


# ---- errors across the pipe (as data: the parent raises its own exception) -----------------


def _failed(request_id: str, error: BaseException) -> msg.RequestFailed:
    if isinstance(error, InvalidRequestError):
        return msg.RequestFailed(request_id, msg.Refusal.INVALID, error.field, error.message)
    if isinstance(error, InvalidSamplingParams):
        return msg.RequestFailed(request_id, msg.Refusal.INVALID, error.field, str(error))
    if isinstance(error, (GroupFailure, EngineStopped)):
        return msg.RequestFailed(request_id, msg.Refusal.UNAVAILABLE, "", str(error))
    return msg.RequestFailed(
        request_id, msg.Refusal.FAILURE, "", str(error) or type(error).__name__
    )


def _error(failed: msg.RequestFailed) -> BaseException:
    match failed.refusal:
        case msg.Refusal.INVALID:
            return InvalidRequestError(failed.field, failed.message)
        case msg.Refusal.UNAVAILABLE:
            return EngineStopped(failed.message)
        case msg.Refusal.FAILURE:
            return EngineFailure(failed.message)


# ---- the child -----------------------------------------------------------------------------


class _Tag:
    """A sink in the child: it only names the request; the parent holds the real sink."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id

    def __call__(self, item: RequestOutput | BaseException) -> None:
        # Only EngineLoop.submit after stop calls a sink directly; the parent fails every
        # request itself when the child stops.
        del item


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _forked_main(
    parent_end: Connection, settings: WorkerSettings, conn: Connection, log_level: int
) -> None:
    """Entry point of an engine process forked from its worker (``ProcessEngine.fork_now``): the
    fork copied the worker's end of the pipe, which must close here or the child would never
    read EOF when the worker is gone. No parent-death signal: like the fork server's children
    (the fork server outlives a killed worker while the engine holds its "alive" pipe), the
    engine ends at that EOF and shuts its group down cleanly."""
    parent_end.close()
    set_process_name("gs-engine")
    _child_main(settings, conn, log_level, die_with_parent=False)


def _child_main(
    settings: WorkerSettings, conn: Connection, log_level: int, die_with_parent: bool = True
) -> None:
    """Entry point of the engine process."""
    if die_with_parent:
        _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    from gearshift.worker.server.engine_loop import Delivery, EngineLoop
    from gearshift.worker.server.factory import build_engine

    try:
        engine = build_engine(settings)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which exits non-zero
        msg.FROM_ENGINE.send(conn, msg.StartFailed(f"{type(exc).__name__}: {exc}"))
        return
    blocks = engine.blocks
    log.info(
        "KV cache: %d blocks x %d tokens = %d tokens; max model len %d; %d rank(s), policy %s",
        blocks.num_blocks,
        blocks.block_size,
        blocks.num_blocks * blocks.block_size,
        engine.max_model_len,
        settings.ranks,
        engine.policy.kind,
    )
    lock = threading.Lock()

    def send(message: msg.Event) -> None:
        data = msg.FROM_ENGINE.encode(message)
        with lock:
            conn.send_bytes(data)

    def deliver(batch: Delivery) -> None:
        items: list[RequestOutput | msg.RequestFailed] = [
            item if isinstance(item, RequestOutput) else _failed(sink.request_id, item)  # type: ignore[attr-defined]
            for sink, item in batch
        ]
        send(msg.Outputs(items, engine.stats(), engine.dead))

    loop = EngineLoop(engine, deliver)
    loop.start()
    send(msg.EngineReady(engine.max_model_len, engine.policy.to_proto()))
    stop = threading.Event()

    def report_stats() -> None:
        while not stop.wait(STATS_INTERVAL_S):
            send(msg.StatsReport(loop.snapshot, engine.dead))

    threading.Thread(target=report_stats, name="stats", daemon=True).start()

    def reply(token: int, call: Future[Any], answer: Callable[[Any], msg.Reply]) -> None:
        def done(future: Future[Any]) -> None:
            exc = future.exception()
            if exc is None:
                send(answer(future.result()))
            elif isinstance(exc, InvalidRequestError):
                send(msg.CallFailed(token, exc.field, exc.message))
            else:
                send(msg.CallFailed(token, "", f"{type(exc).__name__}: {exc}"))

        call.add_done_callback(done)

    def apply(values: dict[str, LiveValue]) -> Any:
        def run(e: Any) -> policy_pb2.Policy:
            e.policy.update_live(values)
            return e.policy.to_proto()

        return run

    try:
        while True:
            try:
                command = msg.TO_ENGINE.recv(conn)
            except (EOFError, OSError):
                break  # the parent is gone
            match command:
                case msg.AddRequest():
                    rid = command.request_id
                    ids, params = command.prompt_token_ids, command.params
                    loop.submit(rid, ids, params, _Tag(rid), command.arrival_time)
                case msg.AbortRequest():
                    found = loop.abort(command.request_id)
                    reply(command.token, found, functools.partial(msg.Aborted, command.token))
                case msg.ApplyLive():
                    live = loop.call(apply(command.values))
                    reply(command.token, live, functools.partial(msg.LiveApplied, command.token))
                case msg.StopEngine():
                    break
    finally:
        stop.set()
        loop.stop()
        engine.shutdown()
        with contextlib.suppress(OSError):
            send(msg.EngineExit())


# ---- the parent ----------------------------------------------------------------------------


class EngineStartError(GearshiftError):
    """The engine process could not build the engine (the message says why)."""


class ProcessEngine:
    """An EngineHandle whose engine runs in a child process."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.max_model_len = 0
        self.replicas = 1
        self.plan_field: str | None = None
        self.policy = policy_pb2.Policy()
        self._snapshot: EngineStats | None = None
        self._dead: str | None = None
        self._sinks: dict[str, OutputSink] = {}
        self._replies: dict[int, asyncio.Future[msg.Reply]] = {}
        self._tokens = itertools.count()
        self._ready: asyncio.Future[None] | None = None
        self._closed = False
        self._watcher: asyncio.Future[None] | None = None
        # The child reports stats every STATS_INTERVAL_S; silence this long means it hangs
        # (e.g. SIGSTOP): the group's leader rank, which its watchdog cannot judge itself.
        self._hung_after_s = max(settings.heartbeat_timeout_s, 4 * STATS_INTERVAL_S)
        self._last_heard = time.monotonic()
        ctx = rank_context()  # a restart after a failure does not re-import torch
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=start_in_environment,
            args=(
                dict(os.environ),
                "gs-engine",
                _child_main,
                settings,
                child,
                logging.getLogger().level,
            ),
            name=f"gearshift-engine-{settings.group_name or 'local'}",
        )
        self._child_conn = child
        self._forked = False

    def fork_now(self) -> bool:
        """Start the engine process now by forking this one, where that is the fork server's
        own situation: no thread of Python's (gRPC, asyncio and the engine loop start later)
        and no CUDA context. The worker calls it first thing, and saves the fork server's
        start (a Python interpreter importing torch and the engine again: over 2 s of CPU) at
        every group start. Returns False, and ``start`` uses the fork server, otherwise."""
        import torch

        if self._forked or threading.active_count() > 1 or torch.cuda.is_initialized():
            return self._forked
        ctx = multiprocessing.get_context("fork")
        self._proc = ctx.Process(
            target=_forked_main,
            args=(self._conn, self.settings, self._child_conn, logging.getLogger().level),
            name=self._proc.name,
        )
        self._proc.start()
        self._child_conn.close()
        self._forked = True
        return True

    def kill(self) -> None:
        """Kill the engine process if it still runs (its worker is failing); it was stopped
        cleanly otherwise. Its followers end with it (their fork server's "alive" pipe)."""
        if self._proc.pid is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)

    async def start(self) -> None:
        """Start the child (unless ``fork_now`` did) and wait until its engine is built (or
        failed)."""
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        if not self._forked:
            self._proc.start()
            self._child_conn.close()
        loop.add_reader(self._conn.fileno(), self._on_readable)
        self._watcher = asyncio.ensure_future(self._watch_exit())
        await self._ready

    async def _watch_exit(self) -> None:
        while self._proc.is_alive():
            await asyncio.sleep(0.2)
            silent = time.monotonic() - self._last_heard
            loaded = self._ready is not None and self._ready.done()
            if loaded and not self._closed and silent > self._hung_after_s:
                reason = f"the engine process (rank 0) stopped responding for {silent:.1f} s"
                log.error("%s; killing it", reason)
                self._proc.kill()
                self._close(reason)
                return
        self._close(self._leader_gone())

    def _leader_gone(self) -> str:
        """Why the group ended when the engine process (the group's rank 0) went away."""
        # A killed child closes its pipe before the parent can read its exit code; a short wait
        # (only on this failure path) lets the message say how it ended.
        self._proc.join(0.5)
        code = self._proc.exitcode
        how = "closed its pipe" if code is None else f"exited with code {code}"
        if code is not None and code < 0:
            how += f" ({signal.Signals(-code).name})"
        return f"rank 0 (the group leader's engine process, pid {self._proc.pid}) {how}"

    def _on_readable(self) -> None:
        self._last_heard = time.monotonic()
        try:
            while self._conn.poll():
                self._handle(msg.FROM_ENGINE.recv(self._conn))
        except (EOFError, OSError):
            self._close(self._leader_gone())
        except WireError as exc:  # a bug on one side of the pipe: the engine cannot be trusted
            log.error("the engine process sent a message this process refuses: %s", exc)
            self._proc.kill()
            self._close(f"the engine process sent a bad message ({exc})")

    def _handle(self, message: msg.Event) -> None:
        match message:
            case msg.Outputs():
                self._snapshot, self._dead = message.stats, message.dead
                for item in message.items:
                    out = item if isinstance(item, RequestOutput) else _error(item)
                    finished = not isinstance(out, RequestOutput) or out.finished
                    rid = item.request_id
                    sink = self._sinks.pop(rid, None) if finished else self._sinks.get(rid)
                    if sink is not None:
                        sink(out)
            case msg.StatsReport():
                self._snapshot, self._dead = message.stats, message.dead
            case msg.Aborted() | msg.LiveApplied() | msg.CallFailed():
                future = self._replies.pop(message.token, None)
                if future is not None and not future.done():
                    if isinstance(message, msg.CallFailed):
                        future.set_exception(InvalidRequestError(message.field, message.message))
                    else:
                        future.set_result(message)
            case msg.EngineReady():
                self.max_model_len, self.policy = message.max_model_len, message.policy
                if self._ready is not None and not self._ready.done():
                    self._ready.set_result(None)
            case msg.StartFailed():
                self._close(message.message)
            case msg.EngineExit():
                pass  # the process is ending: _watch_exit says how

    def _close(self, reason: str) -> None:
        """The child is gone: fail everything that waits on it."""
        if self._closed:
            return
        self._closed = True
        self._dead = self._dead or reason
        with contextlib.suppress(ValueError, OSError):
            asyncio.get_running_loop().remove_reader(self._conn.fileno())
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(EngineStartError(reason))
        for sink in self._sinks.values():
            sink(EngineStopped(reason))
        self._sinks.clear()
        for future in self._replies.values():
            if not future.done():
                future.set_exception(EngineStopped(reason))
        self._replies.clear()

    # ---- EngineHandle ---------------------------------------------------------------------

    @property
    def snapshot(self) -> EngineStats:
        return self._snapshot or EngineStats(0, 0, 0, 0, 0.0, 0, 0, 0, 0, 0, 0)

    @property
    def stats_extra(self) -> worker_pb2.WorkerStats | None:
        return None

    @property
    def dead(self) -> str | None:
        return self._dead

    @property
    def alive(self) -> bool:
        return not self._closed and self._proc.is_alive()

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sink: OutputSink,
        arrival_time: float,
        replica: int | None = None,
        plan: Message | None = None,
    ) -> None:
        del replica, plan  # one engine: the caller checked it is 0 or None; takes no plan
        if self._closed:
            sink(EngineStopped(self._dead or "the engine is shutting down"))
            return
        self._sinks[request_id] = sink
        add = msg.AddRequest(request_id, prompt_token_ids, params, arrival_time)
        msg.TO_ENGINE.send(self._conn, add)

    async def _call(self, command: Callable[[int], msg.Command]) -> msg.Reply:
        """Send ``command(token)`` and wait for the answer that repeats the token."""
        if self._closed:
            raise EngineStopped(self._dead or "the engine is shutting down")
        token = next(self._tokens)
        future: asyncio.Future[msg.Reply] = asyncio.get_running_loop().create_future()
        self._replies[token] = future
        msg.TO_ENGINE.send(self._conn, command(token))
        return await future

    async def abort(self, request_id: str) -> bool:
        reply = await self._call(functools.partial(msg.AbortRequest, request_id))
        assert isinstance(reply, msg.Aborted)
        return reply.found

    async def apply_live(self, values: dict[str, LiveValue]) -> policy_pb2.Policy:
        reply = await self._call(functools.partial(msg.ApplyLive, values))
        assert isinstance(reply, msg.LiveApplied)
        self.policy = reply.policy
        return reply.policy

    async def stop(self, timeout_s: float = 15.0) -> None:
        """Stop the engine (aborting what runs), then the process; kill it if it hangs."""
        if self._proc.is_alive() and not self._closed:
            with contextlib.suppress(OSError):
                msg.TO_ENGINE.send(self._conn, msg.StopEngine())
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self._proc.is_alive() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
            self._on_readable()
        if self._proc.is_alive():
            self._proc.kill()
        await asyncio.to_thread(self._proc.join, 5)
        self._close("the engine stopped")
        if self._watcher is not None:
            self._watcher.cancel()
        self._conn.close()
