"""An async context manager (servers on loopback) entered on an event loop of its own thread, so
a synchronous test (Hypothesis, a blocking gRPC client) can call the servers it yields."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Generic, TypeVar

T = TypeVar("T")


class Background(Generic[T]):
    """`with Background(lambda: cm()) as value:` runs `cm` on a loop in a thread; bounded."""

    def __init__(
        self, factory: Callable[[], AbstractAsyncContextManager[T]], timeout_s: float = 180
    ) -> None:
        self.factory = factory
        self.timeout_s = timeout_s
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="servers")
        self._cm: AbstractAsyncContextManager[T] | None = None

    def call(self, fn: Callable[[], T]) -> T:
        """`fn()` on the servers' loop (for their state), waited for."""

        async def run() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(self.timeout_s)

    def __enter__(self) -> T:
        self.thread.start()
        self._cm = self.factory()
        try:
            return asyncio.run_coroutine_threadsafe(self._cm.__aenter__(), self.loop).result(
                self.timeout_s
            )
        except BaseException:
            self._stop()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            assert self._cm is not None
            asyncio.run_coroutine_threadsafe(
                self._cm.__aexit__(None, None, None), self.loop
            ).result(self.timeout_s)
        finally:
            self._stop()

    def _stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        if not self.thread.is_alive():
            self.loop.close()
