"""The engine in a child process, driven from the gRPC process's event loop over a pipe.

Like vLLM's engine core: the forward pass and the gRPC/protobuf work run in separate
interpreters, so neither waits for the other's GIL. The child runs the same EngineLoop; each
step's outputs cross the pipe as one message, with the latest stats.

Parent → child: ("add", rid, ids, params, arrival) | ("abort", rid, token) |
("live", values, token) | ("stop",). Child → parent: ("ready", max_model_len, policy) |
("failed", message) | ("out", [(rid, item)], stats, dead) | ("stats", stats, dead) |
("reply", token, ok, value).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import logging
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from gearshift.v1 import policy_pb2
from gearshift.worker.engine.contract import LiveValue
from gearshift.worker.engine.llm_engine import EngineStats
from gearshift.worker.engine.outputs import RequestOutput
from gearshift.worker.errors import GearshiftError, GroupFailure, InvalidRequestError
from gearshift.worker.launch.processes import rank_context, start_in_environment
from gearshift.worker.sampling.params import InvalidSamplingParams, SamplingParams
from gearshift.worker.server.engine_loop import EngineFailure, EngineStopped, OutputSink
from gearshift.worker.server.settings import WorkerSettings

log = logging.getLogger(__name__)
STATS_INTERVAL_S = 0.25


# ---- errors across the pipe (exceptions with custom __init__ do not unpickle) -------------


def _to_wire(item: RequestOutput | BaseException) -> Any:
    if isinstance(item, RequestOutput):
        return item
    if isinstance(item, InvalidRequestError):
        return ("invalid", item.field, item.message)
    if isinstance(item, InvalidSamplingParams):
        return ("invalid", item.field, str(item))
    if isinstance(item, (GroupFailure, EngineStopped)):
        return ("unavailable", "", str(item))
    return ("failure", "", str(item) or type(item).__name__)


def _from_wire(item: Any) -> RequestOutput | BaseException:
    if isinstance(item, RequestOutput):
        return item
    kind, field, message = item
    if kind == "invalid":
        return InvalidRequestError(field, message)
    if kind == "unavailable":
        return EngineStopped(message)
    return EngineFailure(message)


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


def _child_main(settings: WorkerSettings, conn: Connection, log_level: int) -> None:
    """Entry point of the engine process."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    from gearshift.worker.server.engine_loop import Delivery, EngineLoop
    from gearshift.worker.server.factory import build_engine

    try:
        engine = build_engine(settings)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which exits non-zero
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
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

    def send(message: tuple[Any, ...]) -> None:
        with lock:
            conn.send(message)

    def deliver(batch: Delivery) -> None:
        items = [(sink.request_id, _to_wire(item)) for sink, item in batch]  # type: ignore[attr-defined]
        send(("out", items, engine.stats(), engine.dead))

    loop = EngineLoop(engine, deliver)
    loop.start()
    send(("ready", engine.max_model_len, engine.policy.to_proto()))
    stop = threading.Event()

    def report_stats() -> None:
        while not stop.wait(STATS_INTERVAL_S):
            send(("stats", loop.snapshot, engine.dead))

    threading.Thread(target=report_stats, name="stats", daemon=True).start()

    def reply(token: int, call: Any) -> None:
        def done(future: Any) -> None:
            exc = future.exception()
            if exc is None:
                send(("reply", token, True, future.result()))
            elif isinstance(exc, InvalidRequestError):
                send(("reply", token, False, (exc.field, exc.message)))
            else:
                send(("reply", token, False, ("", f"{type(exc).__name__}: {exc}")))

        call.add_done_callback(done)

    def apply(values: dict[str, LiveValue]) -> Any:
        def run(e: Any) -> policy_pb2.Policy:
            e.policy.update_live(values)
            return e.policy.to_proto()

        return run

    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break  # the parent is gone
            kind = message[0]
            if kind == "add":
                _, rid, ids, params, arrival = message
                loop.submit(rid, ids, params, _Tag(rid), arrival)
            elif kind == "abort":
                reply(message[2], loop.abort(message[1]))
            elif kind == "live":
                reply(message[2], loop.call(apply(message[1])))
            elif kind == "stop":
                break
    finally:
        stop.set()
        loop.stop()
        engine.shutdown()
        with contextlib.suppress(OSError):
            send(("stopped",))


# ---- the parent ----------------------------------------------------------------------------


class EngineStartError(GearshiftError):
    """The engine process could not build the engine (the message says why)."""


class ProcessEngine:
    """An EngineHandle whose engine runs in a child process."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.max_model_len = 0
        self.replicas = 1
        self.policy = policy_pb2.Policy()
        self._snapshot: EngineStats | None = None
        self._dead: str | None = None
        self._sinks: dict[str, OutputSink] = {}
        self._replies: dict[int, asyncio.Future[Any]] = {}
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

    async def start(self) -> None:
        """Start the child and wait until its engine is built (or failed)."""
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
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
                self._handle(self._conn.recv())
        except (EOFError, OSError):
            self._close(self._leader_gone())

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "out":
            _, items, stats, dead = message
            self._snapshot, self._dead = stats, dead
            for rid, item in items:
                out = _from_wire(item)
                finished = not isinstance(out, RequestOutput) or out.finished
                sink = self._sinks.pop(rid, None) if finished else self._sinks.get(rid)
                if sink is not None:
                    sink(out)
        elif kind == "stats":
            self._snapshot, self._dead = message[1], message[2]
        elif kind == "reply":
            _, token, ok, value = message
            future = self._replies.pop(token, None)
            if future is not None and not future.done():
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(InvalidRequestError(*value))
        elif kind == "ready":
            _, self.max_model_len, self.policy = message
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(None)
        elif kind == "failed":
            self._close(message[1])

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
    ) -> None:
        del replica  # one engine: the caller checked it is 0 or None
        if self._closed:
            sink(EngineStopped(self._dead or "the engine is shutting down"))
            return
        self._sinks[request_id] = sink
        self._conn.send(("add", request_id, prompt_token_ids, params, arrival_time))

    async def _call(self, *message: Any) -> Any:
        if self._closed:
            raise EngineStopped(self._dead or "the engine is shutting down")
        token = next(self._tokens)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._replies[token] = future
        self._conn.send((*message, token))
        return await future

    async def abort(self, request_id: str) -> bool:
        return bool(await self._call("abort", request_id))

    async def apply_live(self, values: dict[str, LiveValue]) -> policy_pb2.Policy:
        policy: policy_pb2.Policy = await self._call("live", values)
        self.policy = policy
        return policy

    async def stop(self, timeout_s: float = 15.0) -> None:
        """Stop the engine (aborting what runs), then the process; kill it if it hangs."""
        if self._proc.is_alive() and not self._closed:
            with contextlib.suppress(OSError):
                self._conn.send(("stop",))
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
