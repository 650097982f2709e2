"""`gearshift serve` as a test subprocess: OS-picked ports, bounded waits, no orphans."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil


class ServeProcess:
    """Starts `gearshift serve ARGS` and reads the ports from its ready file."""

    def __init__(
        self, tmp: Path, *args: str, start_timeout: float = 240.0, log_level: str | None = "INFO"
    ) -> None:
        self.tmp = tmp
        self.ready_file = tmp / "serve.ready"
        self.log = tmp / "serve.log"
        self.args = [
            *args,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--grpc-port",
            "0",
            "--admin-port",
            "0",
            "--ready-file",
            str(self.ready_file),
        ]
        self.start_timeout = start_timeout
        # None: the CLI's own default level, as a user running `make serve` sees it.
        self.log_flags = [] if log_level is None else ["--log-level", log_level]
        self.proc: subprocess.Popen[bytes] | None = None
        self.info: dict[str, Any] = {}
        self._descendants: list[psutil.Process] = []

    def __enter__(self) -> ServeProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GEARSHIFT_")}
        self._log = self.log.open("wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gearshift.operator.cli",
                *self.log_flags,
                "serve",
                *self.args,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.monotonic() + self.start_timeout
        while not self.ready_file.is_file():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self._kill_all()
                raise RuntimeError(f"gearshift serve did not start:\n{self.tail()}")
            time.sleep(0.2)
        self.info = json.loads(self.ready_file.read_text())
        self._descendants = psutil.Process(self.proc.pid).children(recursive=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (drain, then stop the groups); the exit code. Kills on timeout."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._kill_all()
        self._kill_all()
        self._log.close()
        return int(self.proc.returncode if self.proc.returncode is not None else -9)

    def _kill_all(self) -> None:
        assert self.proc is not None
        procs = [*self._descendants]
        if self.proc.poll() is None:
            procs += psutil.Process(self.proc.pid).children(recursive=True)
            self.proc.kill()
            self.proc.wait(10)
        for p in procs:
            if p.is_running():
                p.kill()
        psutil.wait_procs(procs, timeout=10)

    def survivors(self) -> list[psutil.Process]:
        """Processes started by serve that are still alive (must be none after stop)."""
        return [p for p in self._descendants if p.is_running() and p.status() != "zombie"]

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.is_file() else ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.info['http_port']}"

    @property
    def admin_address(self) -> str:
        return f"127.0.0.1:{self.info['admin_port']}"

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.info['grpc_port']}"

    @property
    def control_token(self) -> str:
        """The token `gearshift serve` generated for router → worker calls."""
        return Path(self.info["control_token_file"]).read_text().strip()

    @property
    def admin_token(self) -> str:
        """The token `gearshift serve` generated for Admin calls."""
        return Path(self.info["admin_token_file"]).read_text().strip()

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata that authenticates a test as the operator (Admin)."""
        return (("authorization", f"Bearer {self.admin_token}"),)

    @property
    def worker_metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata that authenticates a test as the router (Worker calls)."""
        return (("authorization", f"Bearer {self.control_token}"),)

    def refresh(self) -> None:
        """Re-read the ready file (rewritten when a worker group restarts)."""
        self.info = json.loads(self.ready_file.read_text())

    def group(self, name: str) -> dict[str, Any]:
        return next(g for g in self.info["groups"] if g["name"] == name)

    def worker_pid(self, name: str) -> int:
        return int(self.group(name)["pid"])


def wait_for(predicate: Any, timeout: float, what: str, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def named_descendants(pid: int, prefix: str) -> list[psutil.Process]:
    """Processes under ``pid`` whose name (what ``ps`` shows) starts with ``prefix``: ranks are
    forked from fork servers, so they are found by the names they set (gs-engine, gs-rank-N,
    gs-replica-N), not by their parent or command line."""
    found = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if p.name().startswith(prefix):
                found.append(p)
        except psutil.Error:
            continue
    return sorted(found, key=lambda p: p.name())
