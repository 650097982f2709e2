"""A served replica group is one failure domain: one killed replica ends the whole group, the
worker names it, the router stops routing to it, and no replica outlives `gearshift serve`."""

from __future__ import annotations

import os
import signal

import httpx
import psutil
import pytest

from tests.e2e.serve_process import ServeProcess, named_descendants, wait_for


@pytest.fixture
def sidp_serve(tmp_path):
    proc = ServeProcess(
        tmp_path,
        "--model",
        "smollm2",
        "--dtype",
        "float32",
        "--policy-config",
        '{"sidp": {"dp": 2}}',
        "--max-num-seqs",
        "2",
        "--max-model-len",
        "256",
        "--kv-cache-bytes",
        str(32 << 20),
        "--max-group-restarts",
        "0",  # the dead group stays dead (tests/e2e/test_recovery.py covers restarts)
    )
    with proc:
        try:
            yield proc
        finally:
            assert proc.stop() == 0, proc.tail()
            assert proc.survivors() == [], "replica processes outlived gearshift serve"


def _replicas(worker_pid: int) -> list[psutil.Process]:
    """The worker's replica processes (by the names they set, gs-replica-N)."""
    return named_descendants(worker_pid, "gs-replica-")


def test_a_killed_replica_ends_the_group_and_the_router_stops_routing(
    sidp_serve: ServeProcess,
) -> None:
    r = httpx.post(
        f"{sidp_serve.url}/v1/completions",
        timeout=120,
        json={"model": "smollm2", "prompt": "Hi", "max_tokens": 3, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    replicas = _replicas(sidp_serve.worker_pid("gearshift-g0"))
    assert len(replicas) == 2, [p.cmdline() for p in replicas]
    replicas[1].send_signal(signal.SIGKILL)
    wait_for(
        lambda: httpx.get(f"{sidp_serve.url}/ready", timeout=10).status_code == 503,
        60,
        "/ready 503 once the group's replica died",
    )
    log = sidp_serve.tail(20000)
    assert "replica group: replica" in log and "exited with code -9" in log, log[-3000:]
    # Its peer went with it: the group is one failure domain.
    wait_for(lambda: not replicas[0].is_running() or replicas[0].status() == "zombie", 30, "peer")
    # The killed replicas' shared-memory FFN segments are unlinked by the worker.
    pids = {str(p.pid) for p in replicas}
    wait_for(
        lambda: (
            not [n for n in os.listdir("/dev/shm") if n.split("-")[3:4] and n.split("-")[3] in pids]
        ),
        30,
        "the dead replicas' segments unlinked",
    )
    r = httpx.post(
        f"{sidp_serve.url}/v1/completions",
        timeout=60,
        json={"model": "smollm2", "prompt": "Hi", "max_tokens": 3},
    )
    assert r.status_code == 503, r.text
