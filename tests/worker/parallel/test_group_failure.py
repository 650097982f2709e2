"""A dead rank takes the whole group down quickly, and every survivor says which rank died."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return []
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


# TP 3, and PP 3 (each rank a pipeline stage: the middle one and the last, which sends the
# logits to the leader).
POLICIES = {"tp3": '{"static": {"tp": 3}}', "pp3": '{"static": {"pp": 3}}'}


@pytest.mark.parametrize("victim", [2, 1])
@pytest.mark.parametrize("layout", list(POLICIES))
def test_killing_a_rank_mid_generation_stops_the_group_with_the_rank_named(
    layout, victim, tiny_checkpoint
):
    folder = tiny_checkpoint("llama2-bias", num_heads=6, num_kv_heads=3, hidden=48, layers=3)
    cmd = [
        sys.executable,
        "-m",
        "tests.worker.parallel.group_driver",
        "--model",
        str(folder),
        "--policy-config",
        POLICIES[layout],
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    followers: list[int] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line.startswith("ranks"):
                followers = [int(p) for p in line.split()[1:]]
            if line.startswith("generating") or not line:
                break
        assert len(followers) == 2, "the group did not start"
        time.sleep(1.0)  # mid-generation
        os.kill(followers[victim - 1], signal.SIGKILL)
        started = time.monotonic()
        out, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for pid in followers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert f"rank {victim}" in err + out, err[-2000:]
    assert elapsed < 45, f"the leader took {elapsed:.0f} s to give up"
    survivor = followers[2 - victim]
    assert _wait_gone([survivor], 30) == [], "the surviving follower did not exit"
