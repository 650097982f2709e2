"""Authentication fails closed at start-up (issue 31, item 3), as the processes are run: a worker
or a router without its tokens refuses to start unless told `--insecure-no-auth` (then it warns),
and an empty or blank API key never opens the API."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

CLI = [sys.executable, "-m", "gearshift.operator.cli", "--log-level", "INFO"]


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("GEARSHIFT_CONTROL_TOKEN_FILE", "GEARSHIFT_ADMIN_TOKEN_FILE")
        and k != "GEARSHIFT_API_KEY"
    }
    return env | extra


def _run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=120, env=env or _env()
    )


def _router_json(tmp: Path, **extra: object) -> Path:
    path = tmp / "router.json"
    path.write_text(json.dumps({"model": {"name": "m", "path": "smollm2"}, "groups": [], **extra}))
    return path


_ROUTER_PORTS = ["--host", "127.0.0.1", "--port", "0", "--grpc-port", "0", "--admin-port", "0"]


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 30 s: nothing outlives the test."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def test_a_worker_without_a_control_token_refuses_to_start() -> None:
    done = _run(["worker", "--port", "0"])
    assert done.returncode == 2, done.stderr
    assert "no token configured" in done.stderr and "--insecure-no-auth" in done.stderr
    assert "loading" not in done.stderr  # refused before any model is read


def test_a_worker_with_an_empty_token_file_refuses_to_start(tmp_path: Path) -> None:
    empty = tmp_path / "token"
    empty.write_text(" \n")
    done = _run(["worker", "--port", "0", "--control-token-file", str(empty)])
    assert done.returncode == 2 and "is empty" in done.stderr, done.stderr


@pytest.mark.slow
def test_a_worker_with_insecure_no_auth_starts_and_warns(tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*CLI, "worker", "--insecure-no-auth", "--host", "127.0.0.1", "--port", "0"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_env(),
        )
        try:
            deadline = time.monotonic() + 120
            port = None
            while port is None:
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                found = re.search(r"gRPC on 127\.0\.0\.1:(\d+)", log.read_text())
                port = int(found.group(1)) if found else None
                time.sleep(0.1)
            assert "NOT authenticated" in log.read_text()
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                health = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=10
                )
            assert health.status in (
                health_pb2.HealthCheckResponse.SERVING,
                health_pb2.HealthCheckResponse.NOT_SERVING,  # still loading the model
            )
        finally:
            _stop(proc)


def test_a_router_without_tokens_refuses_to_start(tmp_path: Path) -> None:
    done = _run(["router", "--config", str(_router_json(tmp_path)), *_ROUTER_PORTS])
    assert done.returncode == 2, done.stderr
    assert "no token configured" in done.stderr and "--insecure-no-auth" in done.stderr
    # With the workers' token but no admin token the Admin service still refuses to start.
    token = tmp_path / "control"
    token.write_text("c0ntrol")
    done = _run(
        ["router", "--config", str(_router_json(tmp_path)), *_ROUTER_PORTS],
        _env(GEARSHIFT_CONTROL_TOKEN_FILE=str(token)),
    )
    assert done.returncode == 2 and "admin: no token configured" in done.stderr, done.stderr


@pytest.mark.slow
def test_a_router_with_insecure_no_auth_starts_and_warns(tmp_path: Path) -> None:
    ready, log = tmp_path / "ready.json", tmp_path / "router.log"
    args = ["router", "--config", str(_router_json(tmp_path)), "--insecure-no-auth"]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*CLI, *args, *_ROUTER_PORTS, "--ready-file", str(ready)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_env(),
        )
        try:
            deadline = time.monotonic() + 120
            while not ready.is_file():
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            assert json.loads(ready.read_text())["admin_port"] > 0
            assert "NOT authenticated" in log.read_text()
        finally:
            _stop(proc)


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--api-key", ""], {"GEARSHIFT_API_KEY": "k"}, "empty or blank API key"),
        (["--api-key", "   "], {"GEARSHIFT_API_KEY": "k"}, "empty or blank API key"),
        ([], {"GEARSHIFT_API_KEY": " "}, "$GEARSHIFT_API_KEY (the API key) is unset, empty"),
        ([], {"GEARSHIFT_API_KEY": ""}, "$GEARSHIFT_API_KEY (the API key) is unset, empty"),
        ([], {}, "$GEARSHIFT_API_KEY (the API key) is unset, empty"),  # the Secret is missing
        (["--api-key-file", "{blank}"], {"GEARSHIFT_API_KEY": "k"}, "holds no key"),
    ],
)
def test_a_router_refuses_an_empty_or_blank_api_key(
    tmp_path: Path, args: list[str], env: dict[str, str], message: str
) -> None:
    blank = tmp_path / "keys"
    blank.write_text("# keys, one per line\n   \n")
    # router.json names the variable the way the operator does when apiKeySecret is set.
    config = _router_json(tmp_path, apiKeyEnv="GEARSHIFT_API_KEY")
    argv = ["router", "--config", str(config), "--insecure-no-auth", *_ROUTER_PORTS]
    done = _run([*argv, *(a.replace("{blank}", str(blank)) for a in args)], _env(**env))
    assert done.returncode == 2, done.stderr
    assert message in done.stderr


@pytest.mark.parametrize(
    ("args", "env"), [(["--api-key", " "], {}), ([], {"GEARSHIFT_API_KEY": "  "})]
)
def test_serve_refuses_a_blank_api_key_before_starting_any_worker(
    args: list[str], env: dict[str, str]
) -> None:
    done = _run(["serve", "--port", "0", "--worker-start-timeout", "5", *args], _env(**env))
    assert done.returncode == 2, done.stderr
    assert "would let anyone in" in done.stderr
