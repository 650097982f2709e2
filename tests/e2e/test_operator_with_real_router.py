"""The operator (kopf, against kmock) drives the real router of `gearshift serve`.

docs/operator.md, "Tests and what is still open": one group named like the operator's (NAME-g0)
under shift sp=1 tp=1; the router's GetStatus makes the deployment Ready; a threshold patch is
applied live through Admin.ApplyPolicy with no pod or StatefulSet revision change.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
import yaml

from gearshift.operator.reconcile import names
from gearshift.v1 import router_pb2, router_pb2_grpc
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
NAME = "live"
REPO = Path(__file__).resolve().parents[2]
STS = f"/apis/apps/v1/namespaces/{NS}/statefulsets"


def _resource() -> dict[str, Any]:
    body = yaml.safe_load((REPO / "docs/examples/shift.yaml").read_text())
    body["metadata"] = {
        "name": NAME,
        "namespace": NS,
        "uid": f"uid-{NAME}",
        "generation": 1,
        "resourceVersion": "1",
    }
    spec = copy.deepcopy(body["spec"])
    spec["replicas"] = 1
    spec["group"] = {"nodes": 1, "gpusPerNode": 1, "gpuResource": ""}
    spec["policy"] = {"shift": {"sp": 1, "tp": 1, "threshold": 256}}
    spec["model"] = {"source": "/models/smollm2", "name": "smollm2"}
    spec.pop("router", None)
    body["spec"] = spec
    return body


def _router_threshold(serve: ServeProcess) -> int | None:
    with grpc.insecure_channel(serve.admin_address) as channel:
        st = router_pb2_grpc.AdminStub(channel).GetStatus(
            router_pb2.GetStatusRequest(), timeout=5, metadata=serve.metadata
        )
    group = next((g for g in st.groups if g.name == f"{NAME}-g0"), None)
    return group.policy.shift.threshold if group is not None and group.serving else None


def _token_file(tmp: Path, name: str) -> Path:
    """A token file the test later fills from the operator's Secret, as the kubelet would."""
    return auth.write_token(tmp / name, auth.generate_token())


@pytest.mark.slow
def test_operator_applies_a_live_threshold_through_the_real_router(tmp_path: Path) -> None:
    serve = ServeProcess(
        tmp_path,
        "--model",
        "smollm2",
        "--dtype",
        "bfloat16",
        "--name",
        NAME,
        "--groups",
        "1",
        "--policy",
        "shift",
        "--sp",
        "1",
        "--tp",
        "1",
        "--max-num-seqs",
        "4",
        "--max-model-len",
        "1024",
        "--kv-cache-bytes",
        str(32 << 20),
        "--control-token-file",
        str(_token_file(tmp_path, "control.token")),
        "--admin-token-file",
        str(admin_token := _token_file(tmp_path, "admin.token")),
    )
    with serve, KmockApi() as kmock:
        api = Api(kmock.url)
        kubeconfig = kmock.kubeconfig(tmp_path / "kubeconfig")
        with OperatorProcess(kubeconfig, serve.admin_address, tmp_path / "kopf.log") as op:
            try:
                api.create_cr(NS, _resource())
                # The router's admin token comes from the Secret the operator writes (a mounted
                # file, re-read when it changes): only then does Admin admit the operator.
                token = mount_secret_token(api, NS, names.admin_secret(NAME), admin_token)
                assert serve.admin_token == token
                wait_for(
                    lambda: condition(api.cr(NS, NAME), "Ready").get("status") == "True",
                    timeout=60,
                    what="Ready from the real router's GetStatus",
                )
                sts = api.get(f"{STS}/{NAME}-g0")
                assert sts is not None
                revision = sts["metadata"]["labels"][names.LABEL_REVISION]
                assert _router_threshold(serve) == 256

                api.patch_spec(NS, NAME, {"policy": {"shift": {"sp": 1, "tp": 1, "threshold": 64}}})
                wait_for(lambda: _router_threshold(serve) == 64, timeout=60, what="threshold 64")

                obj = api.cr(NS, NAME)
                assert condition(obj, "Ready")["status"] == "True"
                assert condition(obj, "Degraded")["status"] == "False"
                after = api.get(f"{STS}/{NAME}-g0")
                assert after is not None
                assert after["metadata"]["labels"][names.LABEL_REVISION] == revision
                # The worker process was never restarted.
                assert serve.proc is not None and serve.proc.poll() is None
                assert psutil.pid_exists(serve.worker_pid(f"{NAME}-g0"))
            finally:
                print(op.log.read_text()[-3000:])
        assert serve.stop() == 0
        assert serve.survivors() == []
