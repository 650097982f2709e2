"""Ctrl-C (or SIGTERM) stops `gearshift profile` at once, in the middle of profiling: its rank
processes, fork server and helpers end with it, nothing is written to ``-o``, and it exits 130
(143) with one line. A leader interrupted inside a step's collectives used to say goodbye to
ranks still waiting in that step, and waited on them until gloo's timeout (two minutes)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts real worker groups

READY = ("worker group ready", "engine ready")  # logged once the layout's engine is up
EXIT_BOUND_S = 20.0  # a hang guard, not a timing claim: the stop takes about a second


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from benchmarks.sim_fidelity import random_llama

    return random_llama(tmp_path_factory.mktemp("interrupt") / "model", hidden=64, layers=2)


def group_members(pgid: int) -> list[str]:
    """The live (not zombie) processes of process group ``pgid``: "pid name" each."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :]
        fields = rest.split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(f"{entry.name} {name}")
    return found


@pytest.mark.parametrize(
    ("flags", "sig", "whole_group", "code"),
    [
        # `kill -INT` to the command alone (the audit's case: it hung for the gloo timeout)
        (["--layouts", "tp2"], signal.SIGINT, False, 130),
        # Ctrl-C in a terminal: the whole foreground process group, ranks included
        (["--layouts", "tp2"], signal.SIGINT, True, 130),
        (["--layouts", "tp2"], signal.SIGTERM, True, 143),
        ([], signal.SIGINT, False, 130),  # one rank, no --layouts
    ],
    ids=["tp2-sigint", "tp2-ctrl-c", "tp2-sigterm", "one-sigint"],
)
def test_a_signal_stops_profiling_at_once_and_leaves_nothing(
    model: Path,
    tmp_path: Path,
    flags: list[str],
    sig: signal.Signals,
    whole_group: bool,
    code: int,
) -> None:
    out, log = tmp_path / "profile.json", tmp_path / "stderr.log"
    # The full grid (no --quick): the profile runs for many seconds after the ready line.
    cmd = [sys.executable, "-m", "gearshift.operator.cli", "profile", "--model", str(model),
           "--dtype", "float32", "--max-model-len", "1024", "--max-num-batched-tokens", "512",
           "--num-threads", "1", *flags, "-o", str(out)]  # fmt: skip
    with log.open("wb") as err:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            cwd=tmp_path,
            start_new_session=True,  # its own process group: the ranks and helpers join it
        )
    pgid = proc.pid
    try:
        deadline = time.monotonic() + 120
        while not any(line in log.read_text() for line in READY):
            assert proc.poll() is None, f"profile exited early:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"profile never got ready:\n{log.read_text()}"
            time.sleep(0.05)
        time.sleep(0.5)  # into the profile's steps
        assert proc.poll() is None
        if whole_group:
            os.killpg(pgid, sig)
        else:
            proc.send_signal(sig)
        try:
            returncode = proc.wait(EXIT_BOUND_S)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"still running {EXIT_BOUND_S:.0f} s after {sig.name}: {group_members(pgid)}"
            )
        text = log.read_text()
        assert returncode == code, text
        assert text.rstrip().splitlines()[-1] == f"error: interrupted ({sig.name})", text
        assert "Traceback" not in text, text
        assert not out.exists()
        left = group_members(pgid)
        settle = time.monotonic() + 5  # the fork server and resource tracker see EOF and end
        while left and time.monotonic() < settle:
            time.sleep(0.1)
            left = group_members(pgid)
        assert left == [], f"left running after the profile exited: {left}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        proc.wait(10)
