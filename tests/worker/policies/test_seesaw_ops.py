"""Seesaw in operation: live parameters, stats that reach /metrics, aborts in every state, and
no segment, thread or process left behind, also when a rank is SIGKILLed mid-swap."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.policies.registry import make_policy
from gearshift.worker.policies.seesaw.host_kv import PREFIX, SHM_DIR, PageShape, clean_stale
from gearshift.worker.sampling.params import SamplingParams
from tests.worker.policies.test_seesaw import (
    DEVICE_KV,
    ENGINE,
    _model,
    _prompts,
    _seesaw,
    no_leftover_segments,  # noqa: F401 - a fixture
)

REPO = Path(__file__).resolve().parents[3]
P2, T2 = {"tp": 1, "pp": 2}, {"tp": 2, "pp": 1}
STATS = (
    "transitions",
    "reshard_seconds",
    "swap_out_bytes",
    "swap_in_bytes",
    "swap_wait_seconds",
    "swap_waiting_sequences",
    "swap_stall_seconds",
    "host_kv_usage",
    "phase_decode",
)


def test_live_thresholds_apply_and_bad_values_are_refused_naming_the_field():
    policy = make_policy(_seesaw(P2, T2))
    assert policy._thresholds().to_decode == 1.0
    policy.update_live({"switch_to_decode_at_host_usage": 0.5, "prefetch_max_sequences": 3})
    assert policy._thresholds().to_decode == 0.5 and policy._thresholds().prefetch_max == 3
    with pytest.raises(InvalidRequestError, match="switchToPrefillAtHostUsage must be below"):
        policy.update_live({"switch_to_prefill_at_host_usage": 0.9})
    with pytest.raises(InvalidRequestError) as err:
        policy.update_live({"async_swap": False})
    assert err.value.field == "seesaw.async_swap"
    assert policy._thresholds().to_prefill == 0.0  # nothing of a refused update applied


def _thread_names() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("seesaw-")}


def test_every_stat_moves_and_reaches_the_metrics(
    no_leftover_segments,  # noqa: F811
    tiny_checkpoint,
    group_factory,
):
    from prometheus_client import CollectorRegistry, generate_latest

    from gearshift.operator.router.metrics import GroupCollector
    from gearshift.worker.server.convert import worker_stats

    folder = _model(tiny_checkpoint)
    engine = group_factory(folder, _seesaw(P2, T2), kv_cache_bytes=DEVICE_KV, **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i, prompt in enumerate(_prompts(8)):
        engine.add_request(f"r{i}", prompt, params)
    seen = dict.fromkeys(STATS, 0.0)
    snapshot = None
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.stats()
        for k in STATS:
            seen[k] = max(seen[k], stats.policy_stats[k])
        if stats.policy_stats["host_kv_usage"] > 0 and snapshot is None:
            snapshot = stats
    # The engine stalls only if copies are slower than its look at the board: it may not here.
    moved = {k: v for k, v in seen.items() if k != "swap_stall_seconds"}
    assert all(v > 0 for v in moved.values()), [k for k, v in moved.items() if v <= 0]
    assert _thread_names() == {"seesaw-swap-out", "seesaw-prefetch"}
    assert snapshot is not None
    proto = worker_stats(
        snapshot, model="m", max_model_len=64, policy=engine.policy.to_proto(), ranks=2, revision=""
    )
    assert proto.host_kv_usage == pytest.approx(snapshot.policy_stats["host_kv_usage"])
    group = SimpleNamespace(
        name="g0", serving=True, load=SimpleNamespace(in_flight=0), room=(), stats=proto
    )
    registry = CollectorRegistry()
    registry.register(GroupCollector("m", lambda: [group]))
    text = generate_latest(registry).decode()
    for k in STATS:
        assert f'gearshift_policy_stat{{group="g0",model_name="m",stat="{k}"}}' in text, k


def test_aborts_in_every_state_free_every_page_and_block(
    no_leftover_segments,  # noqa: F811
    tiny_checkpoint,
    group_factory,
):
    folder = _model(tiny_checkpoint)
    engine = group_factory(folder, _seesaw(P2, T2), kv_cache_bytes=DEVICE_KV, **ENGINE)
    lead = engine.policy.leader
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i, prompt in enumerate(_prompts(14)):
        engine.add_request(f"r{i}", prompt, params)
    aborted: dict[str, str] = {}
    states = {
        "waiting": lambda: [s.request_id for s in engine.scheduler.waiting],
        "host-resident": lambda: list(lead.on_host),
        "being swapped in": lambda: list(lead.queue.pending),
        "decoding": lambda: [
            r.request_id for r in lead._resident() if lead.phase.value == "decode"
        ],
    }
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        for state, ids in states.items():
            if state not in aborted.values() and ids():
                rid = ids()[0]
                assert engine.abort_request(rid)
                aborted[rid] = state
    assert sorted(aborted.values()) == sorted(states), aborted
    while engine.has_unfinished_requests():
        engine.step()
    assert lead.pages.used == 0 and not lead.on_host and not lead.draining
    assert engine.blocks.leaked_blocks() == []


def _segments(tag: str) -> list[str]:
    return [p.name for p in SHM_DIR.glob(f"{PREFIX}{tag}-*")]


def test_a_stale_segment_of_a_dead_leader_is_removed_at_the_next_start(tmp_path):
    tag = f"t{os.getpid()}"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    stale = SHM_DIR / f"{PREFIX}{tag}-{int(dead.stdout)}-0123456789ab"
    stale.write_bytes(b"\0" * 4096)
    live = SHM_DIR / f"{PREFIX}{tag}-{os.getpid()}-0123456789ab"  # a leader still running
    live.write_bytes(b"\0" * 4096)
    try:
        assert clean_stale(tag) == [stale.name]
        assert not stale.exists() and live.exists()
    finally:
        stale.unlink(missing_ok=True)
        live.unlink(missing_ok=True)
    assert PageShape(2, 2, 4, 8, __import__("torch").float32).nbytes == 2 * 2 * 2 * 4 * 8 * 4


def _alive(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def _start(folder: Path, tag: str, **env_vars: str) -> tuple[subprocess.Popen[str], list[int]]:
    env = dict(os.environ, GEARSHIFT_GROUP_NAME=tag, **env_vars)
    cmd = [sys.executable, "-m", "tests.worker.policies.seesaw_driver", "--model", str(folder)]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    followers: list[int] = []
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("ranks"):
            followers = [int(p) for p in line.split()[1:]]
        if line.startswith("generating") or not line:
            break
    return proc, followers


@pytest.mark.parametrize("victim", ["follower", "leader"])
def test_sigkill_mid_swap_ends_the_group_and_leaves_no_segment(victim, tiny_checkpoint):
    folder = _model(tiny_checkpoint)
    tag = f"kill{os.getpid()}{victim}"
    proc, followers = _start(folder, tag)
    try:
        assert len(followers) == 1, "the group did not start"
        assert len(_segments(tag)) == 1
        time.sleep(2.0)  # prompts are moving through the host store all the time
        os.kill(followers[0] if victim == "follower" else proc.pid, signal.SIGKILL)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in followers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in followers), "a rank outlived its group"
    if victim == "follower":
        assert proc.returncode == 4 and "rank 1" in err, err[-2000:]
        assert _segments(tag) == [], "the leader did not unlink its segment"
        return
    # A SIGKILLed leader cannot unlink: the next start of the same group cleans the segment.
    assert len(_segments(tag)) == 1
    again, followers = _start(folder, tag)
    try:
        assert len(followers) == 1 and len(_segments(tag)) == 1
        assert f"-{again.pid}-" in _segments(tag)[0]
    finally:
        again.send_signal(signal.SIGKILL)
        again.communicate()
        for seg in _segments(tag):
            (SHM_DIR / seg).unlink()
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in followers) and time.monotonic() < deadline:
            time.sleep(0.2)


def test_a_group_spanning_nodes_is_refused_naming_the_field():
    import yaml

    from gearshift.operator.reconcile.reconciler import runnable_spec
    from gearshift.operator.reconcile.spec import SpecError

    body = yaml.safe_load((REPO / "docs" / "examples" / "seesaw.yaml").read_text())
    body["metadata"].update(namespace="ns", uid="u", generation=1, resourceVersion="1")
    assert runnable_spec(body).group.nodes == 1
    body["spec"]["group"].update(nodes=2, gpusPerNode=4)
    with pytest.raises(SpecError) as err:
        runnable_spec(body)
    assert err.value.field == "spec.group.nodes"


def test_host_capacity_comes_from_bytes_or_a_fraction_of_the_memory_limit():
    from gearshift.worker.policies.seesaw.policy import memory_limit

    assert make_policy(_seesaw(P2, T2)).host_capacity_bytes() == 28 * 2048
    by_fraction = make_policy({"seesaw": {"hostKvCapacityFraction": 0.001}})
    shm = os.statvfs(SHM_DIR)
    want = min(int(memory_limit() * 0.001), shm.f_bavail * shm.f_frsize)
    assert by_fraction.host_capacity_bytes() == pytest.approx(want, rel=0.01)
