"""`engine: vllm` end to end under the operator (kopf, against kmock): the static-vllm example
reaches Ready through a real `gearshift router` whose router.json is the operator's own
rendering (backend openai-http), its group an OpenAI server on loopback standing in for the vLLM
pod (`gearshift serve` with SmolLM2), and a completion through that router is answered."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from gearshift.operator.reconcile import names, render_config
from gearshift.operator.reconcile.spec import parse
from gearshift.worker.server import auth
from tests.e2e.serve_process import ServeProcess
from tests.operator.kmock_harness import (
    Api,
    KmockApi,
    OperatorProcess,
    condition,
    mount_secret_token,
    wait_for,
)

NS = "ml"
REPO = Path(__file__).resolve().parents[2]


def _resource() -> dict[str, Any]:
    body = dict(yaml.safe_load((REPO / "docs/examples/static-vllm.yaml").read_text()))
    body["metadata"].update(namespace=NS, uid="uid-vllm", generation=1, resourceVersion="1")
    body["spec"]["group"] = {"nodes": 1, "gpusPerNode": 1, "gpuResource": ""}
    body["spec"]["policy"] = {"static": {"tp": 1}}
    return body


def _router_json(body: dict[str, Any], backend: str, path: Path) -> Path:
    """The operator's router.json for this resource, pointed at the stand-in backend."""
    cfg = render_config.router_config(parse(body), [0], "cluster.local")
    assert cfg["backend"] == "openai-http"
    cfg["groups"][0]["address"] = backend
    cfg["model"]["path"] = "smollm2"  # the stand-in's tokenizer, not the example's PVC
    path.write_text(json.dumps(cfg))
    return path


class RouterProcess:
    """`gearshift router --config router.json` on OS-picked loopback ports."""

    def __init__(self, config: Path, tmp: Path) -> None:
        self.ready = tmp / "router.ready"
        self.log = tmp / "router.log"
        # The pod's token mounts: filled from the operator's Secrets once it wrote them.
        self.admin_token = auth.write_token(tmp / "admin.token", auth.generate_token())
        self.env = {**os.environ, auth.ADMIN_TOKEN_FILE_ENV: str(self.admin_token)}
        self.cmd = [
            sys.executable,
            "-m",
            "gearshift.operator.cli",
            "--log-level",
            "INFO",
            "router",
            "--config",
            str(config),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--grpc-port",
            "0",
            "--admin-host",
            "127.0.0.1",
            "--admin-port",
            "0",
            "--ready-file",
            str(self.ready),
        ]
        self.info: dict[str, Any] = {}

    def __enter__(self) -> RouterProcess:
        self._out = self.log.open("wb")
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._out, stderr=subprocess.STDOUT, env=self.env
        )
        deadline = time.monotonic() + 120
        while not self.ready.is_file():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"router did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)
        self.info = json.loads(self.ready.read_text())
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._out.close()


@pytest.mark.slow
def test_static_vllm_example_becomes_ready_and_serves_through_the_router(tmp_path: Path) -> None:
    body = _resource()
    name = body["metadata"]["name"]
    (tmp_path / "backend").mkdir()
    backend = ServeProcess(
        tmp_path / "backend",
        "--model",
        "smollm2",
        "--dtype",
        "bfloat16",
        "--max-num-seqs",
        "2",
        "--max-model-len",
        "512",
        "--kv-cache-bytes",
        str(16 << 20),
    )
    with backend:
        config = _router_json(body, backend.url.removeprefix("http://"), tmp_path / "router.json")
        with RouterProcess(config, tmp_path) as router, KmockApi() as kmock:
            api = Api(kmock.url)
            admin = f"127.0.0.1:{router.info['admin_port']}"
            kubeconfig = kmock.kubeconfig(tmp_path / "kubeconfig")
            with OperatorProcess(kubeconfig, admin, tmp_path / "kopf.log") as op:
                try:
                    api.create_cr(NS, body)
                    admin_secret = names.admin_secret(name)
                    mount_secret_token(api, NS, admin_secret, router.admin_token)
                    wait_for(
                        lambda: condition(api.cr(NS, name), "Ready").get("status") == "True",
                        timeout=90,
                        what="Ready from the router's openai-http group",
                    )
                    obj = api.cr(NS, name)
                    assert obj is not None
                    assert "1/1 groups serving" in condition(obj, "Ready")["message"]
                    sts = api.get(f"/apis/apps/v1/namespaces/{NS}/statefulsets/{name}-g0")
                    assert sts is not None
                    worker = sts["spec"]["template"]["spec"]["containers"][0]
                    assert worker["command"] == ["vllm", "serve"]
                    assert worker["ports"][0]["containerPort"] == names.VLLM_HTTP_PORT
                finally:
                    print(op.log.read_text()[-3000:])
            r = httpx.post(
                f"http://127.0.0.1:{router.info['http_port']}/v1/completions",
                json={"model": "qwen2.5-32b", "prompt": "Hello", "max_tokens": 4},
                timeout=120,
            )
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "qwen2.5-32b" and r.json()["choices"][0]["text"]
    assert backend.survivors() == []
