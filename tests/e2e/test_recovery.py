"""A hung or dead worker group under `gearshift serve`: not ready within 5 s, then restarted
(bounded back-off, counted in metrics) and serving again."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.serve_process import ServeProcess, named_descendants, wait_for

GROUP = "gearshift-g0"


@pytest.fixture(scope="module")
def serve_pp2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """One group of two ranks (pipeline stages: the cheapest multi-rank SmolLM2 group), so a
    follower rank can hang."""
    proc = ServeProcess(
        tmp_path_factory.mktemp("serve-recovery"),
        "--model",
        "smollm2",
        "--dtype",
        "bfloat16",
        "--groups",
        "1",
        "--pp",
        "2",
        "--max-num-seqs",
        "4",
        "--max-model-len",
        "1024",
        "--kv-cache-bytes",
        str(32 << 20),
    )
    with proc:
        try:
            yield proc
        finally:
            assert proc.stop() == 0, proc.tail()
            leftovers = [p for p in psutil.process_iter() if _is_rank_of(p, proc)]
            assert leftovers == [], "rank processes outlived gearshift serve"


def _is_rank_of(p: psutil.Process, serve: ServeProcess) -> bool:
    try:
        return serve.proc is not None and serve.proc.pid in [a.pid for a in p.parents()]
    except psutil.Error:
        return False


def _ranks(serve: ServeProcess) -> list[psutil.Process]:
    """Rank 0 (the engine process, under the group's worker process), then its followers."""
    engines = named_descendants(serve.worker_pid(GROUP), "gs-engine")
    assert len(engines) == 1, f"{len(engines)} engine processes under the worker"
    followers = named_descendants(engines[0].pid, "gs-rank-")
    assert followers, f"no followers under engine {engines[0].pid}"
    return [engines[0], *followers]


def _ready(serve: ServeProcess) -> int:
    return httpx.get(f"{serve.url}/ready", timeout=5).status_code


def _serves(serve: ServeProcess) -> bool:
    r = httpx.post(
        f"{serve.url}/v1/completions",
        json={"model": "smollm2", "prompt": "Hello", "max_tokens": 4, "temperature": 0},
        timeout=60,
    )
    return r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def _restarts(serve: ServeProcess) -> float:
    text = httpx.get(f"{serve.url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == "gearshift_group_restarts":
            return sum(
                s.value
                for s in family.samples
                if s.name.endswith("_total") and s.labels.get("group") == GROUP
            )
    return 0.0


def _wait_back(serve: ServeProcess, old_pid: int) -> None:
    """Until the ready file names a new worker process and the router serves again."""

    def back() -> bool:
        serve.refresh()
        return serve.worker_pid(GROUP) != old_pid and _ready(serve) == 200

    wait_for(back, 240, "the restarted group serving", interval=0.5)
    assert _serves(serve)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["follower", "leader"])
def test_a_hung_rank_turns_ready_503_within_5s_then_the_group_restarts(
    serve_pp2: ServeProcess, which: str
) -> None:
    serve_pp2.refresh()
    wait_for(lambda: _ready(serve_pp2) == 200, 240, "ready before the hang", 0.5)
    assert _serves(serve_pp2)
    before = _restarts(serve_pp2)
    old_pid = serve_pp2.worker_pid(GROUP)
    ranks = _ranks(serve_pp2)
    rank = ranks[1] if which == "follower" else ranks[0]
    rank.send_signal(signal.SIGSTOP)
    try:
        # A follower: the leader's watchdog (2.5 s heartbeat timeout). The leader: the worker
        # process, which hears from it every 0.25 s. Then the router's 0.5 s poll.
        wait_for(lambda: _ready(serve_pp2) == 503, 5.0, f"/ready 503 after SIGSTOP ({which})", 0.1)
    finally:
        if rank.is_running():
            rank.send_signal(signal.SIGCONT)
    _wait_back(serve_pp2, old_pid)
    assert not rank.is_running() or rank.status() == psutil.STATUS_ZOMBIE
    assert _restarts(serve_pp2) == before + 1
    assert f"restart {int(before) + 1}" in serve_pp2.tail(100_000)


@pytest.mark.slow
def test_a_killed_group_comes_back_and_serves_again(serve_pp2: ServeProcess) -> None:
    serve_pp2.refresh()
    wait_for(lambda: _ready(serve_pp2) == 200, 240, "ready before the kill", 0.5)
    before = _restarts(serve_pp2)
    old_pid = serve_pp2.worker_pid(GROUP)
    os.killpg(old_pid, signal.SIGKILL)  # the worker and every rank of the group
    wait_for(lambda: _ready(serve_pp2) == 503, 30, "/ready 503 after the kill", 0.2)
    _wait_back(serve_pp2, old_pid)
    assert _restarts(serve_pp2) == before + 1
