"""`gearshift worker --config engine.json` as the operator runs it: health, revision, SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gearshift.operator.reconcile import render_config, spec
from gearshift.v1 import common_pb2, worker_pb2, worker_pb2_grpc

REPO = Path(__file__).resolve().parents[2]


def _engine_json(tmp: Path) -> Path:
    body = yaml.safe_load((REPO / "docs/examples/shift.yaml").read_text())
    body["metadata"] = {"name": "demo", "namespace": "ml"}
    body["spec"]["group"] = {"nodes": 1, "gpusPerNode": 1}
    body["spec"]["policy"] = {"shift": {"sp": 1, "tp": 1, "threshold": 100}}
    body["spec"]["model"] = {"source": "/models/x", "name": "demo-model", "maxModelLen": 512}
    cfg = render_config.engine_config(spec.parse(body))
    cfg["model"]["path"] = "smollm2"  # the embedded model stands in for the pod's volume
    path = tmp / "engine.json"
    path.write_text(json.dumps(cfg))
    return path


TOKEN = "worker-test-token"


def _refused(call: grpc.RpcError) -> bool:
    return isinstance(call, grpc.Call) and call.code() == grpc.StatusCode.UNAUTHENTICATED


def _worker_cmd(tmp: Path, ready: Path, *extra: str) -> list[str]:
    """`gearshift worker` on the shift example's engine.json (the embedded model, one rank)."""
    return [
        sys.executable,
        "-m",
        "gearshift.operator.cli",
        "worker",
        "--config",
        str(_engine_json(tmp)),
        *extra,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--ready-file",
        str(ready),
        "--kv-cache-bytes",
        str(16 << 20),
        "--dtype",
        "bfloat16",
    ]


def _wait_ready(proc: subprocess.Popen[bytes], ready: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready.is_file():
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        assert time.monotonic() < deadline, "worker not ready in time"
        time.sleep(0.1)


@pytest.mark.slow
def test_worker_serves_health_stats_with_revision_and_stops_on_sigterm(tmp_path: Path) -> None:
    """Also: every Worker call needs the control token (health stays open), SIGUSR1 stops
    admission (preStop), SIGTERM then exits 0."""
    ready = tmp_path / "ready.json"
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    env = {
        **os.environ,
        "GEARSHIFT_REVISION": "9219d0c3ca3e",
        "GEARSHIFT_GROUP_NAME": "demo-g0",
        "GEARSHIFT_CONTROL_TOKEN_FILE": str(token_file),
    }
    cmd = _worker_cmd(tmp_path, ready, "--max-num-seqs", "2")
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE)
    try:
        _wait_ready(proc, ready, 120)
        port = json.loads(ready.read_text())["port"]
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="gearshift.v1.Worker"), timeout=5
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            stub = worker_pb2_grpc.WorkerStub(channel)
            good = (("authorization", f"Bearer {TOKEN}"),)
            bad = (("authorization", "Bearer not-the-token"),)
            calls = [
                lambda md: stub.GetStats(worker_pb2.GetStatsRequest(), timeout=5, metadata=md),
                lambda md: stub.Abort(
                    worker_pb2.AbortRequest(request_id="x"), timeout=5, metadata=md
                ),
                lambda md: stub.ApplyPolicy(
                    worker_pb2.ApplyPolicyRequest(), timeout=5, metadata=md
                ),
                lambda md: list(
                    stub.Generate(
                        worker_pb2.WorkerGenerateRequest(request_id="r", prompt_token_ids=[1, 2]),
                        timeout=5,
                        metadata=md,
                    )
                ),
            ]
            for call in calls:
                for md in (None, bad):
                    with pytest.raises(grpc.RpcError) as refused:
                        call(md)
                    assert _refused(refused.value), refused.value
            stats = stub.GetStats(worker_pb2.GetStatsRequest(), timeout=5, metadata=good)
            out = list(
                stub.Generate(
                    worker_pb2.WorkerGenerateRequest(
                        request_id="ok",
                        prompt_token_ids=[1, 2, 3],
                        sampling=common_pb2.SamplingParams(max_tokens=2),
                    ),
                    timeout=60,
                    metadata=good,
                )
            )
            assert sum(len(r.token_ids) for r in out) == 2
            # preStop: SIGUSR1 stops admission; health turns NOT_SERVING, Generate UNAVAILABLE.
            proc.send_signal(signal.SIGUSR1)
            health_stub = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest(service="gearshift.v1.Worker")
            deadline = time.monotonic() + 10
            while health_stub.Check(request, timeout=5).status == (
                health_pb2.HealthCheckResponse.SERVING
            ):
                assert time.monotonic() < deadline, "SIGUSR1 did not stop admission"
                time.sleep(0.05)
            with pytest.raises(grpc.RpcError) as refused:
                calls[3](good)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
        assert stats.revision == "9219d0c3ca3e"
        assert stats.model == "demo-model" and stats.max_model_len == 512 and stats.ranks == 1
        assert stats.policy.shift.threshold == 100 and stats.policy.shift.sp == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stderr:
            proc.stderr.close()


@pytest.mark.slow
def test_the_engine_process_is_forked_from_its_worker_and_ends_when_the_worker_is_killed(
    tmp_path: Path,
) -> None:
    """No fork server is started for a one-engine group (the worker forks its engine process
    before any thread starts), and the engine process holds no copy of the worker's end of
    their pipe: killed, the worker leaves no engine behind."""
    import psutil

    ready = tmp_path / "ready.json"
    cmd = _worker_cmd(tmp_path, ready, "--insecure-no-auth")
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE)
    engine = None
    try:
        _wait_ready(proc, ready, 120)
        children = psutil.Process(proc.pid).children()
        assert [c.name() for c in children] == ["gs-engine"], [c.cmdline() for c in children]
        engine = children[0]
        assert not any("forkserver" in " ".join(c.cmdline()) for c in children)
        proc.kill()
        proc.wait(10)
        engine.wait(30)  # psutil.TimeoutExpired if it outlives its worker
        engine = None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if engine is not None and engine.is_running():
            engine.kill()
