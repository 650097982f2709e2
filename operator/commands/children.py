"""Worker groups as child processes of `gearshift serve`: start, wait until ready, restart, stop.

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
from collections.abc import Awaitable, Callable
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


@dataclass(frozen=True)
class RestartPolicy:
    """How `gearshift serve` restarts a worker group that died, as the operator does in a
    cluster: doubling back-off, capped; the count resets once a group has served a while."""

    max_restarts: int = 10  # consecutive; 0: never restart
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    settle_s: float = 60.0
    start_timeout_s: float = 600.0

    def backoff(self, restarts: int) -> float:
        return min(self.backoff_s * 2**restarts, self.max_backoff_s)


# Called with the group's name and its restart count when a restarted group is serving again.
OnRestarted = Callable[[WorkerChild, int], Awaitable[None]]


async def supervise(
    children: list[WorkerChild],
    respawn: Callable[[WorkerChild, int], WorkerChild],
    policy: RestartPolicy,
    on_restarted: OnRestarted,
) -> None:
    """Restart each child that exits (bounded back-off); replaces it in `children` in place."""
    await asyncio.gather(
        *(_supervise_one(children, i, respawn, policy, on_restarted) for i in range(len(children)))
    )


async def _supervise_one(
    children: list[WorkerChild],
    index: int,
    respawn: Callable[[WorkerChild, int], WorkerChild],
    policy: RestartPolicy,
    on_restarted: OnRestarted,
) -> None:
    restarts, total, started = 0, 0, time.monotonic()
    never = asyncio.Event()  # wait_ready's stop: cancelling this task is how serve stops
    while True:
        child = children[index]
        while child.alive:
            await asyncio.sleep(0.2)
        if time.monotonic() - started > policy.settle_s:
            restarts = 0
        if restarts >= policy.max_restarts:
            log.error(
                "worker group %s exited with code %s; not restarting it (%d restarts in a row, "
                "the limit)",
                child.name,
                child.proc.returncode,
                restarts,
            )
            return
        delay = policy.backoff(restarts)
        restarts, total = restarts + 1, total + 1
        log.warning(
            "worker group %s exited with code %s; restart %d in %.0f s",
            child.name,
            child.proc.returncode,
            total,
            delay,
        )
        await asyncio.sleep(delay)
        _signal_group(child, signal.SIGKILL)  # ranks the dead leader left behind
        fresh = children[index] = respawn(child, total)
        started = time.monotonic()
        try:
            await wait_ready([fresh], policy.start_timeout_s, never)
        except ChildFailed as exc:
            log.warning("restart %d of worker group %s failed: %s", total, child.name, exc)
            _signal_group(fresh, signal.SIGKILL)
            continue
        log.info("worker group %s is back (restart %d) on %s", fresh.name, total, fresh.address)
        await on_restarted(fresh, total)
