"""A pickle sent to every listener we run is refused, and nothing is unpickled (issue 31 item 6).

The payload is ``pickle.dumps`` of an object whose ``__reduce__`` makes a folder; loading a twin
of it shows it is live. Each listener is a real server on loopback:

- the router's HTTP API (the pickle as a JSON body): a 4xx;
- the router's gRPC Generation and Admin services and a real ``gearshift worker``'s Worker
  service (the pickle as a request message, through a generic channel call, with the token
  where one is needed): INVALID_ARGUMENT, never UNKNOWN or INTERNAL;
- the Tetris control listener (a dialler with the right key sending the pickle instead of a
  Hello): the connection closed unread;
- every typed pipe codec of worker/ (``wire.Codec``), over a real pipe: WireError.

After each, the folder the pickle would make does not exist.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import re
import subprocess
import sys
import time
from multiprocessing.connection import Client
from pathlib import Path

import grpc
import httpx
import pytest
import torch.distributed as dist

from gearshift.operator.router.server import load_tokenizer
from gearshift.worker.launch.group_config import GroupConfig
from gearshift.worker.launch.tetris.listener import CONTROL_KEY, ControlListener, control_key
from gearshift.worker.wire import Codec, WireError
from tests.fuzz.background import Background
from tests.router.test_router_routing import running
from tests.server.test_worker_process import _engine_json
from tests.worker.policies.tetris.test_tetris_messages import live_pickle

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 30.0
TOKEN = "pickle-test-control-token"
GENERATION = ["/gearshift.v1.Generation/Generate"]
ADMIN = [
    "/gearshift.v1.Admin/ApplyPolicy",
    "/gearshift.v1.Admin/GetStatus",
    "/gearshift.v1.Admin/Drain",
]
WORKER = [
    "/gearshift.v1.Worker/Generate",
    "/gearshift.v1.Worker/Abort",
    "/gearshift.v1.Worker/GetStats",
    "/gearshift.v1.Worker/ApplyPolicy",
    "/gearshift.v1.Worker/ProfileTetris",
]
STREAMING = {"/gearshift.v1.Generation/Generate", "/gearshift.v1.Worker/Generate"}
HTTP_PATHS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]


def _grpc_status(
    channel: grpc.Channel, method: str, payload: bytes, metadata: tuple[tuple[str, str], ...] = ()
) -> grpc.StatusCode:
    """The status a call of ``method`` with ``payload`` as its raw request bytes ends with."""
    try:
        if method in STREAMING:
            for _ in channel.unary_stream(method)(payload, timeout=WAIT_S, metadata=metadata):
                pass
        else:
            channel.unary_unary(method)(payload, timeout=WAIT_S, metadata=metadata)
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[attr-defined, no-any-return]
    return grpc.StatusCode.OK


def test_the_router_refuses_a_pickle_on_http_generation_and_admin(tmp_path: Path) -> None:
    payload, target = live_pickle(tmp_path)
    with Background(lambda: running(load_tokenizer("smollm2"), 1)) as setup:
        ports = setup.server.ports
        assert ports is not None
        base = f"http://127.0.0.1:{ports.http}"
        for path in HTTP_PATHS:
            r = httpx.post(
                base + path, content=payload, headers={"content-type": "application/json"}
            )
            assert 400 <= r.status_code < 500, (path, r.status_code, r.text)
        with grpc.insecure_channel(f"127.0.0.1:{ports.grpc}") as channel:
            for method in GENERATION:
                assert _grpc_status(channel, method, payload) == grpc.StatusCode.INVALID_ARGUMENT
        with grpc.insecure_channel(setup.admin_address) as channel:
            for method in ADMIN:
                assert _grpc_status(channel, method, payload) == grpc.StatusCode.INVALID_ARGUMENT
        # The router still serves: the refusals broke nothing.
        assert httpx.get(base + "/health").status_code == 200
    assert not target.exists(), "the router unpickled what it received"


def test_a_worker_refuses_a_pickle_with_or_without_its_token(tmp_path: Path) -> None:
    payload, target = live_pickle(tmp_path)
    ready = tmp_path / "ready.json"
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    env = {
        **os.environ,
        "GEARSHIFT_GROUP_NAME": "pickle-g0",
        "GEARSHIFT_CONTROL_TOKEN_FILE": str(token_file),
    }
    cmd = [sys.executable, "-m", "gearshift.operator.cli", "worker", "--config"]
    cmd += [str(_engine_json(tmp_path)), "--host", "127.0.0.1", "--port", "0"]
    cmd += ["--ready-file", str(ready), "--kv-cache-bytes", str(16 << 20), "--max-num-seqs", "2"]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, cwd=REPO)
    try:
        deadline = time.monotonic() + 180
        while not ready.is_file():
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "worker not ready in time"
            time.sleep(0.1)
        port = json.loads(ready.read_text())["port"]
        good = (("authorization", f"Bearer {TOKEN}"),)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            for method in WORKER:
                # A stranger is refused before anything is parsed; a caller with the token
                # gets the bytes refused as not the message.
                assert _grpc_status(channel, method, payload) == grpc.StatusCode.UNAUTHENTICATED
                got = _grpc_status(channel, method, payload, good)
                assert got == grpc.StatusCode.INVALID_ARGUMENT, (method, got)
            # Still serving.
            assert _grpc_status(channel, "/gearshift.v1.Worker/GetStats", b"", good) == (
                grpc.StatusCode.OK
            )
    finally:
        proc.terminate()
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
    assert not target.exists(), "the worker unpickled what it received"


def test_the_tetris_control_listener_closes_a_pickle_unread(tmp_path: Path) -> None:
    payload, target = live_pickle(tmp_path)
    store = dist.HashStore()
    listener = ControlListener(store, GroupConfig(control_token=TOKEN), [1])
    try:
        host, port, nonce = store.get(CONTROL_KEY).decode().split(" ")
        conn = Client((host, int(port)), authkey=control_key(TOKEN, bytes.fromhex(nonce)))
        conn.send_bytes(payload)  # instead of a Hello
        assert conn.poll(WAIT_S)
        with pytest.raises((EOFError, OSError)):
            conn.recv_bytes()
        conn.close()
        deadline = time.monotonic() + WAIT_S
        while listener.refused < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert listener.refused == 1 and listener.conns == {}
    finally:
        listener.close()
    assert not target.exists(), "the listener unpickled what it received"


def _codecs() -> dict[str, Codec[object]]:
    """Every module-level typed codec of worker/, found in the source (so a new one is seen)."""
    found: dict[str, Codec[object]] = {}
    for path in sorted((REPO / "worker").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        names = re.findall(r"^([A-Z_]+): Codec\[", text, flags=re.MULTILINE)
        if not names:
            continue
        module = importlib.import_module(
            "gearshift." + ".".join(path.relative_to(REPO).with_suffix("").parts)
        )
        for name in names:
            codec = getattr(module, name)
            assert isinstance(codec, Codec)
            found[f"{module.__name__}.{name}"] = codec
    return found


def test_every_typed_pipe_codec_refuses_a_pickle_over_a_real_pipe(tmp_path: Path) -> None:
    payload, target = live_pickle(tmp_path)
    codecs = _codecs()
    # The pipes of engine_process, replicas, Tetris links and hello, SiDP's and Seesaw's
    # collectives at least.
    want = {
        "server.engine_messages.TO_ENGINE",
        "server.engine_messages.FROM_ENGINE",
        "launch.replica_messages.TO_REPLICA",
        "launch.replica_messages.FROM_REPLICA",
        "launch.tetris.messages.HELLO",
        "launch.tetris.messages.TO_POOL",
        "launch.tetris.messages.FROM_POOL",
        "launch.tetris.messages.TO_DECODE",
        "launch.tetris.messages.FROM_DECODE",
        "policies.sidp.handles.SEGMENTS",
        "policies.seesaw.host_kv.STORE_ADDRESS",
    }
    assert {f"gearshift.worker.{w}" for w in want} <= set(codecs), sorted(codecs)
    for name, codec in codecs.items():
        ours, theirs = multiprocessing.Pipe()
        try:
            theirs.send_bytes(payload)
            with pytest.raises(WireError, match="not a message"):
                codec.recv(ours)
        finally:
            ours.close()
            theirs.close()
        assert not target.exists(), f"{name} unpickled what it received"
