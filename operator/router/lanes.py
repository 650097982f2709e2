"""Where request preparation runs: two bounded lanes off the event loop.

Parsing, validating, templating, compiling grammars and tokenising cost CPU in proportion to
the body (a 40 MiB prompt held the loop, and so `/health`, for 38 s). The loop only moves
bytes; the work runs in one of two lanes, after admission control:

- small bodies (<= `small_body_bytes`, nearly every request) in a few threads: their work is a
  few milliseconds, and the tokenizer, the larger part of it, releases the GIL
  (`Tokenizer.encode`); no process start, no copy;
- larger bodies in worker processes, which hold no GIL of ours: JSON parsing and validation of
  a 4 MiB body take tens to hundreds of milliseconds, during which a thread would hold the
  loop. Separate lanes keep an ordinary request from queueing behind a large one.

Each lane bounds the requests it holds (queued and running); one more is refused with 429 and
Retry-After, before its body is parsed. The processes start on the first large request, load
the tokenizer from the model path themselves, run at a lower priority than the router (a busy
preparation must not take the CPU the event loop needs), and exit when the router stops or
dies.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Concatenate, ParamSpec, TypeVar

from gearshift.operator.router import errors
from gearshift.worker.tokenizer import Tokenizer

log = logging.getLogger(__name__)

P = ParamSpec("P")
T = TypeVar("T")
Work = Callable[Concatenate[Tokenizer, P], T]


@dataclass(frozen=True)
class LaneConfig:
    """Sizes of the two lanes (docs/serving.md, "Limits")."""

    small_body_bytes: int = 16 << 10
    threads: int = 2
    processes: int = 2  # 0: large bodies use the thread lane too
    max_small: int = 64  # requests held (queued + running) before 429
    max_large: int = 8


# The tokenizer of a preparation process: one per process, which exists only to use it.
_CHILD_TOKENIZER: Tokenizer | None = None


# Niceness added to preparation processes: under load the event loop (and the small lane's
# threads) must win the CPU from large preparations, or /health waits on a tokeniser.
CHILD_NICE = 10


def _start_child(model_path: str, parent: int) -> None:
    global _CHILD_TOKENIZER
    from gearshift.operator.router.server import load_tokenizer

    with contextlib.suppress(OSError):
        os.nice(CHILD_NICE)
    _CHILD_TOKENIZER = load_tokenizer(model_path)

    def watch_parent() -> None:
        # A killed router cannot shut the pool down; its processes must not outlive it.
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch_parent, daemon=True, name="watch-router").start()


def _in_child(work: Work[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    assert _CHILD_TOKENIZER is not None, "the preparation process did not load its tokenizer"
    return work(_CHILD_TOKENIZER, *args, **kwargs)


@dataclass
class _Lane:
    name: str
    bound: int
    held: int = 0

    def admit(self) -> None:
        if self.held >= self.bound:
            raise errors.overloaded(
                f"the server is preparing {self.held} {self.name} requests, its limit; retry later"
            )
        self.held += 1


class PreparationLanes:
    """Runs one request's preparation work in the lane its size picks."""

    def __init__(self, config: LaneConfig, tokenizer: Tokenizer, model_path: str) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.model_path = model_path
        self._threads = concurrent.futures.ThreadPoolExecutor(
            max(1, config.threads), thread_name_prefix="prepare"
        )
        self._processes: concurrent.futures.ProcessPoolExecutor | None = None
        self._small = _Lane("small", config.max_small)
        self._large = _Lane("large", config.max_large)

    def lane_of(self, size: int) -> str:
        """ "small" or "large": which lane a body of `size` bytes takes."""
        if size <= self.config.small_body_bytes or self.config.processes <= 0:
            return "small"
        return "large"

    async def run(self, size: int, work: Work[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`work(tokenizer, *args)` in the lane for a body of `size` bytes; 429 when it is full."""
        loop = asyncio.get_running_loop()
        if self.lane_of(size) == "small":
            self._small.admit()
            try:
                call = functools.partial(work, self.tokenizer, *args, **kwargs)
                return await loop.run_in_executor(self._threads, call)
            finally:
                self._small.held -= 1
        self._large.admit()
        try:
            pool = self._process_pool()
            call = functools.partial(_in_child, work, *args, **kwargs)
            try:
                return await loop.run_in_executor(pool, call)
            except BrokenProcessPool:
                # A process died (killed, out of memory): a fresh pool for the next request.
                if self._processes is pool:
                    self._processes = None
                    pool.shutdown(wait=False, cancel_futures=True)
                log.error("a request preparation process exited; restarting the pool")
                raise errors.unavailable(
                    "the process preparing this request exited; retry"
                ) from None
        finally:
            self._large.held -= 1

    def _process_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._processes is None:
            # spawn, not fork: the router's gRPC and event-loop threads must not be forked.
            self._processes = concurrent.futures.ProcessPoolExecutor(
                self.config.processes,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_child,
                initargs=(self.model_path, os.getpid()),
            )
        return self._processes

    @property
    def held(self) -> dict[str, int]:
        """Requests each lane holds now."""
        return {"small": self._small.held, "large": self._large.held}

    def close(self) -> None:
        """Stop both lanes: queued work is dropped, running work (bounded) ends first."""
        self._threads.shutdown(wait=False, cancel_futures=True)
        if self._processes is not None:
            self._processes.shutdown(wait=True, cancel_futures=True)
            self._processes = None
