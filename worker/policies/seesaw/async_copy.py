"""Seesaw §5.2 asynchronous pipeline on one rank: a writer thread that moves swapped-out KV from a
staging buffer into the shared host store while the next prefill steps compute, and a prefetcher
thread that reads swapped-in KV from the store into device blocks while the current step runs.

A swap-out's rows are gathered on the device and copied in one piece into a staging buffer
(pinned when CUDA is present; on a copy stream, rank_hook.py), and the writer thread scatters
them into the store's pages (which are not contiguous); the staging buffer is
``pinned_staging_bytes`` and a swap-out that does not fit waits for the writer to empty it (one
larger than the whole buffer is written directly).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

_STOP = None


class CopyWorker:
    """One thread running copies in submission order; ``join`` waits until all have run."""

    def __init__(self, name: str) -> None:
        self._tasks: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            task = self._tasks.get()
            try:
                if task is _STOP:
                    return
                if self._error is None:
                    task()
            except BaseException as exc:  # noqa: BLE001 - re-raised on the rank's thread by join
                self._error = exc
            finally:
                self._tasks.task_done()

    def submit(self, task: Callable[[], None]) -> None:
        self._tasks.put(task)

    def join(self) -> None:
        """Wait for every submitted copy; a failed copy raises here, on the caller's thread."""
        self._tasks.join()
        if self._error is not None:
            raise RuntimeError(f"asynchronous KV copy failed: {self._error}") from self._error

    def close(self, timeout: float = 10.0) -> None:
        self._tasks.put(_STOP)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


class Staging:
    """A bump allocator over one host buffer, emptied whenever the writer has caught up."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.used = 0

    def take(self, like: torch.Tensor) -> torch.Tensor | None:
        """A staging tensor shaped like ``like`` (None when it does not fit now)."""
        n = like.numel() * like.element_size()
        start = -(-self.used // 64) * 64
        if start + n > self.buffer.numel():
            return None
        self.used = start + n
        return self.buffer[start : start + n].view(like.dtype).view(like.shape)

    def reset(self) -> None:
        self.used = 0
