"""Worker groups as child processes of `gearshift serve`: start, wait until ready, stop.

Each child runs in its own session (process group), so stopping it also stops any rank
processes it spawned, and a Ctrl-C in the terminal reaches only `serve`, which then drains
before it stops the children. Children also exit when `serve` dies (--exit-with-parent).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


class ChildFailed(RuntimeError):
    """A worker group exited or did not become ready in time."""


@dataclass
class WorkerChild:
    """One worker group process and where it listens once ready."""

    name: str
    proc: subprocess.Popen[bytes]
    ready_file: Path
    port: int | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


def spawn_worker(name: str, worker_args: list[str], ready_file: Path) -> WorkerChild:
    """Start `gearshift worker` for group `name` on an OS-picked loopback port."""
    cmd = [
        sys.executable,
        "-m",
        "gearshift.operator.cli",
        "--log-level",
        logging.getLevelName(logging.getLogger().level),
        "worker",
        *worker_args,
        "--group-name",
        name,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--ready-file",
        str(ready_file),
        "--exit-with-parent",
    ]
    # The operator's GEARSHIFT_* variables describe a pod's group; a local group has none.
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEARSHIFT_")}
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    log.info("started worker group %s (pid %d)", name, proc.pid)
    return WorkerChild(name, proc, ready_file)


async def wait_ready(children: list[WorkerChild], timeout_s: float, stop: asyncio.Event) -> None:
    """Wait until every child wrote its ready file; ChildFailed if one exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    pending = list(children)
    while pending:
        for child in list(pending):
            if child.ready_file.is_file():
                child.port = int(json.loads(child.ready_file.read_text())["port"])
                log.info("worker group %s ready on %s", child.name, child.address)
                pending.remove(child)
            elif not child.alive:
                raise ChildFailed(
                    f"worker group {child.name} exited with code {child.proc.returncode} "
                    "before it was ready (its log is above)"
                )
        if pending and stop.is_set():
            raise ChildFailed("stopped while the worker groups were starting")
        if pending and time.monotonic() > deadline:
            names = ", ".join(c.name for c in pending)
            raise ChildFailed(f"worker groups not ready after {timeout_s:.0f}s: {names}")
        if pending:
            await asyncio.sleep(0.1)


def _signal_group(child: WorkerChild, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.proc.pid, sig)


def stop_children(children: list[WorkerChild], timeout_s: float = 15.0) -> None:
    """SIGTERM each group leader, wait (bounded), then SIGKILL its whole process group.

    Only the leader gets SIGTERM: it stops its own ranks in order (a rank signalled at the
    same time would break the leader's last collective).
    """
    for child in children:
        if child.alive:
            child.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(max(0.0, deadline - time.monotonic()))
    for child in children:
        # Also the group's rank processes, even when the leader already exited.
        _signal_group(child, signal.SIGKILL)
        if child.alive:
            log.warning("worker group %s did not stop in time; killed", child.name)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(5)


async def watch_children(children: list[WorkerChild]) -> None:
    """Log a worker group that exits while serving (the router stops routing to it)."""
    reported: set[str] = set()
    while True:
        for child in children:
            if not child.alive and child.name not in reported:
                reported.add(child.name)
                log.warning(
                    "worker group %s exited with code %s", child.name, child.proc.returncode
                )
        await asyncio.sleep(0.5)
