"""Ctrl-C and SIGTERM for a command that runs the engine in its own process (`gearshift profile`).

`gearshift serve` runs its engines in child processes and turns both signals into a stop request
(serve.py, server/app.py). A command that steps the engine itself is interrupted where it is:
SIGTERM is made to raise as Ctrl-C does, the engine's ``shutdown`` then stops the group (its
ranks ignore Ctrl-C: the leader decides; a leader interrupted inside a step kills them instead
of waiting on them, GroupExecutor.guard), and the command exits as serve does on Ctrl-C: 130
(143 for SIGTERM), with one line saying so.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived while the command ran."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Inside, SIGINT and SIGTERM raise ``Interrupted`` in the main thread, as Ctrl-C raises
    KeyboardInterrupt (a second one too: a stop that hangs is cut short, its ranks killed). The
    previous handlers come back on leaving."""

    def stop(signum: int, frame: FrameType | None) -> None:
        del frame
        raise Interrupted(signum)

    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread takes signals (a test calling the command in a thread)
        return
    previous = {sig: signal.signal(sig, stop) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def report(exc: KeyboardInterrupt) -> int:
    """Say that the command was stopped, in one line; its exit code."""
    signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
    print(f"error: interrupted ({signal.Signals(signum).name})", file=sys.stderr)
    return 128 + signum
