"""Every policy's example rendered as GPU worker pods: a GPU per rank, NCCL's environment, a
memory-backed /dev/shm of the spec's size, the CUDA worker image, and a command whose device the
worker's own settings read as ``cuda`` (issue 32, item 6). A CPU deployment renders none of it."""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from gearshift.operator.reconcile import names, render_config, render_workers
from gearshift.operator.reconcile.spec import DeploymentSpec, parse
from gearshift.worker.server import auth
from gearshift.worker.server.factory import engine_config
from gearshift.worker.server.settings import add_worker_args, load_settings

REPO = Path(__file__).resolve().parents[2]
POLICIES = ["static", "shift", "seesaw", "sidp", "tetris"]


def _spec(name: str, **group: Any) -> DeploymentSpec:
    body = dict(yaml.safe_load((REPO / "docs" / "examples" / f"{name}.yaml").read_text()))
    body["metadata"].update(namespace="ml", uid="u-1", generation=1)
    body["spec"]["group"] = {**copy.deepcopy(body["spec"]["group"]), **group}
    return parse(body)


def _pod(spec: DeploymentSpec) -> dict[str, Any]:
    return render_workers.stateful_set(spec, 0, "cluster.local")["spec"]["template"]["spec"]


def _settings(spec: DeploymentSpec, container: dict[str, Any], tmp: Path) -> Any:
    """What `gearshift worker` makes of the rendered arguments, env and engine.json."""
    config = tmp / "engine.json"
    config.write_text(json.dumps(render_config.engine_config(spec)))
    parser = argparse.ArgumentParser()
    add_worker_args(parser)
    assert container["args"][0] == "worker"
    rendered = [str(config) if a == names.ENGINE_CONFIG else a for a in container["args"][1:]]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    token = tmp / "token"  # the mounted Secret's stand-in
    token.write_text("t0ken\n")
    env[auth.TOKEN_FILE_ENV] = str(token)
    return load_settings(parser.parse_args(rendered), env)


@pytest.mark.parametrize("name", POLICIES)
def test_a_gpu_group_pod_gets_a_gpu_per_rank_nccl_shm_the_cuda_image_and_device(name, tmp_path):
    spec = _spec(name, shmSize="64Gi")
    assert spec.group.gpu_resource == "nvidia.com/gpu"  # the default: a GPU deployment
    pod = _pod(spec)
    container = pod["containers"][0]
    per_pod = str(spec.group.gpus_per_node)
    env = {e["name"]: e.get("value") for e in container["env"]}
    # One rank per GPU: the pod asks for as many GPUs as it runs ranks.
    assert container["resources"]["limits"]["nvidia.com/gpu"] == per_pod
    assert container["resources"]["requests"]["nvidia.com/gpu"] == per_pod
    assert env["GEARSHIFT_RANKS_PER_NODE"] == per_pod
    # NCCL: errors and timeouts end the process (the group restarts); the pod's interface.
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert env["NCCL_SOCKET_IFNAME"] == "eth0"
    # /dev/shm: memory-backed, the spec's size (NCCL's buffers, Seesaw's and SiDP's segments).
    assert {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}} in pod["volumes"]
    assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    # The CUDA worker image (docker/worker.Dockerfile) and a command the engine reads as CUDA.
    assert container["image"] == spec.images.worker == "ghcr.io/gearshift/worker:0.1.0"
    assert container["command"] == ["gearshift"]
    settings = _settings(spec, container, tmp_path)
    assert settings.engine.device == "cuda"
    assert engine_config(settings).device == "cuda"
    assert settings.ranks == spec.group.ranks


def test_the_pods_env_overrides_the_nccl_defaults_once():
    override = [{"name": "NCCL_SOCKET_IFNAME", "value": "net1"}]
    container = _pod(_spec("static", env=override))["containers"][0]
    values = [e.get("value") for e in container["env"] if e["name"] == "NCCL_SOCKET_IFNAME"]
    assert values == ["net1"]


def test_a_cpu_group_pod_renders_no_gpu_no_nccl_and_the_cpu_device(tmp_path):
    spec = _spec("static", gpuResource="")
    container = _pod(spec)["containers"][0]
    assert "nvidia.com/gpu" not in json.dumps(container["resources"])
    assert not {e["name"] for e in container["env"]} & set(render_workers.NCCL_ENV)
    assert "--device" not in container["args"]
    assert _settings(spec, container, tmp_path).engine.device == "cpu"
