"""The engine's own thread: the only caller of add/abort/step; RPC handlers reach it by queue.

`LLMEngine` is not thread-safe, while gRPC handlers run on an asyncio loop. Commands (add, abort,
run-a-function) go into one queue that the thread drains at the top of every step; outputs go back
through per-request sinks, which the server turns into `loop.call_soon_threadsafe` calls.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from gearshift.worker.engine.llm_engine import EngineStats, LLMEngine
from gearshift.worker.engine.outputs import RequestMetrics, RequestOutput
from gearshift.worker.engine.sequence import FinishReason
from gearshift.worker.errors import GearshiftError, InvalidRequestError
from gearshift.worker.sampling.params import SamplingParams

log = logging.getLogger(__name__)

T = TypeVar("T")
# Receives every output of one request, or the exception that refused or failed it.
OutputSink = Callable[[RequestOutput | BaseException], None]
Delivery = list[tuple[OutputSink, RequestOutput | BaseException]]
# Hands one step's deliveries to the consumer's thread in one go (one wake-up per step, not one
# per request: a busy event loop thread would otherwise contend for the GIL with every forward).
Deliver = Callable[[Delivery], None]


class EngineFailure(GearshiftError):
    """The engine loop failed outside a request's own fault (a bug or a dead executor)."""


class EngineStopped(GearshiftError):
    """The engine loop has stopped; no request can be added."""


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sink: OutputSink
    arrival_time: float


@dataclass(frozen=True)
class _Abort:
    request_id: str
    done: Future[bool]


@dataclass(frozen=True)
class _Call:
    fn: Callable[[LLMEngine], Any]
    done: Future[Any]


_Command = _Add | _Abort | _Call | None  # None only wakes the thread up


class EngineLoop:
    """Runs `engine` on a dedicated thread; every public method is thread-safe.

    Sinks run where `deliver` puts them (the server's event loop); a refusal in `submit` after
    the loop stopped reaches the sink on the caller's thread.
    """

    def __init__(self, engine: LLMEngine, deliver: Deliver, idle_wait: float = 0.5) -> None:
        self.engine = engine
        self._deliver = deliver
        self._pending: Delivery = []
        self._idle_wait = idle_wait
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._sinks: dict[str, OutputSink] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        # Replaced (never mutated) by the engine thread, so readers on other threads see a
        # consistent snapshot without a lock.
        self.snapshot: EngineStats = engine.stats()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort every request (their sinks get an abort output) and join the thread."""
        self._stopping.set()
        self._commands.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    @property
    def dead(self) -> str | None:
        """Why the group can no longer run steps (a rank died), else None."""
        return self.engine.dead

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sink: OutputSink,
        arrival_time: float,
    ) -> None:
        """Queue a request; a refusal (InvalidRequestError) reaches `sink`, never the caller."""
        if not self.alive:
            sink(EngineStopped("the engine is shutting down"))
            return
        self._commands.put(_Add(request_id, prompt_token_ids, params, sink, arrival_time))

    def abort(self, request_id: str) -> Future[bool]:
        """Abort a request; the future says whether it was still running or waiting."""
        done: Future[bool] = Future()
        if not self.alive:
            done.set_result(False)
            return done
        self._commands.put(_Abort(request_id, done))
        return done

    def call(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Run `fn(engine)` on the engine thread between two steps."""
        done: Future[T] = Future()
        if not self.alive:
            done.set_exception(EngineStopped("the engine is shutting down"))
            return done
        self._commands.put(_Call(fn, done))
        return done

    # ---- the engine thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._drain(block=not self.engine.has_unfinished_requests())
                if self._stopping.is_set():
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
        finally:
            self._shutdown()

    def _drain(self, block: bool) -> None:
        try:
            # Idle: wait for work; busy: take only what is already queued, then step.
            command = self._commands.get(timeout=self._idle_wait) if block else None
        except queue.Empty:
            # Idle for a while: a multi-rank group's followers need to hear from the leader.
            self.engine.keepalive()
            return
        while True:
            if command is not None:
                self._handle(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
        # Stats first: a client that got its last token may ask for them at once.
        self.snapshot = self.engine.stats()
        self._flush()

    def _emit(self, sink: OutputSink, item: RequestOutput | BaseException) -> None:
        self._pending.append((sink, item))

    def _flush(self) -> None:
        if self._pending:
            batch, self._pending = self._pending, []
            self._deliver(batch)

    def _handle(self, command: _Add | _Abort | _Call) -> None:
        if isinstance(command, _Add):
            if command.request_id in self._sinks:
                message = f"request id {command.request_id!r} is already running"
                self._emit(command.sink, InvalidRequestError("request_id", message))
                return
            try:
                self.engine.add_request(
                    command.request_id,
                    command.prompt_token_ids,
                    command.params,
                    arrival_time=command.arrival_time,
                )
            except (ValueError, GearshiftError) as exc:  # a bad request, or a dead group
                self._emit(command.sink, exc)
                return
            self._sinks[command.request_id] = command.sink
        elif isinstance(command, _Abort):
            command.done.set_result(self._abort(command.request_id))
        else:
            try:
                command.done.set_result(command.fn(self.engine))
            except Exception as exc:  # noqa: BLE001 - the caller gets it through the future
                command.done.set_exception(exc)

    def _abort(self, request_id: str) -> bool:
        seq = self.engine.requests.get(request_id)
        found = self.engine.abort_request(request_id)
        sink = self._sinks.pop(request_id, None)
        if sink is not None:
            self._emit(
                sink,
                RequestOutput(
                    request_id=request_id,
                    new_token_ids=[],
                    new_text="",
                    finished=True,
                    finish_reason=FinishReason.ABORT,
                    stop_reason=None,
                    num_prompt_tokens=seq.num_prompt_tokens if seq else 0,
                    num_output_tokens=seq.num_output_tokens if seq else 0,
                    num_cached_tokens=seq.num_cached_tokens if seq else 0,
                    metrics=RequestMetrics(
                        seq.arrival_time if seq else 0.0,
                        seq.first_scheduled_time if seq else None,
                        seq.first_token_time if seq else None,
                        None,
                    ),
                ),
            )
        return found

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            # The engine turns forward-pass failures into per-request errors itself; getting
            # here is a bug. Fail what runs (freeing its blocks) and keep serving new requests.
            log.exception("engine step failed; failing %d requests", len(self._sinks))
            for request_id in list(self._sinks):
                self.engine.abort_request(request_id)
                self._emit(self._sinks.pop(request_id), EngineFailure(f"engine step failed: {exc}"))
            self._flush()
            return
        for out in outputs:
            if out.finished:
                sink = self._sinks.pop(out.request_id, None)
            else:
                sink = self._sinks.get(out.request_id)
            if sink is not None:
                self._emit(sink, out)
        self.snapshot = self.engine.stats()
        self._flush()

    def _shutdown(self) -> None:
        for request_id in list(self._sinks):
            self._abort(request_id)
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                self._emit(command.sink, EngineStopped("the engine is shutting down"))
            elif isinstance(command, _Abort):
                command.done.set_result(False)
            elif isinstance(command, _Call):
                command.done.set_exception(EngineStopped("the engine is shutting down"))
        self.snapshot = self.engine.stats()
        self._flush()
