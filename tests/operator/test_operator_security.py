"""Rendered security of a deployment: control token Secret, NetworkPolicies, hardened pods,
drain-aware grace periods (issue 11, items 1, 2 and 4)."""

from __future__ import annotations

import base64
import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gearshift.operator.reconcile import (
    names,
    render_config,
    render_network,
    render_router,
    render_workers,
    tokens,
)
from gearshift.operator.reconcile.render_network import OperatorPeer
from gearshift.operator.reconcile.settings import OperatorSettings, parse_labels
from gearshift.operator.reconcile.spec import DeploymentSpec, SpecError, parse

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "docs" / "examples").glob("*.yaml"))
K8S_VERSION = kubernetes_validate.utils.latest_version()
OPERATOR = OperatorPeer("gearshift-system", {"app.kubernetes.io/component": "operator"})


def _spec(name: str = "shift", **spec: Any) -> DeploymentSpec:
    body = dict(yaml.safe_load((REPO / "docs" / "examples" / f"{name}.yaml").read_text()))
    body["metadata"].update(namespace="ml", uid="u-1", generation=3)
    body["spec"].update(copy.deepcopy(spec))
    return parse(body)


def _pod(spec: DeploymentSpec) -> dict[str, Any]:
    return dict(render_workers.stateful_set(spec, 0, "cluster.local")["spec"]["template"]["spec"])


def _router_pod(spec: DeploymentSpec) -> dict[str, Any]:
    return dict(render_router.deployment(spec)["spec"]["template"]["spec"])


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container["env"]}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_secret_and_network_policies_of_every_example_pass_kubernetes_validate(
    path: Path,
) -> None:
    spec = _spec(path.stem)
    children = [
        tokens.token_secret(spec, tokens.CONTROL, "t0ken"),
        tokens.token_secret(spec, tokens.ADMIN, "t0ken"),
        render_network.worker_policy(spec, 0),
        render_network.router_policy(spec, OPERATOR),
    ]
    for child in children:
        kubernetes_validate.validate(child, K8S_VERSION, strict=True)
        assert child["metadata"]["ownerReferences"][0]["uid"] == "u-1"


def test_each_token_has_its_own_secret_holding_it_base64_and_nowhere_else() -> None:
    spec = _spec()
    for purpose, name in ((tokens.CONTROL, "control"), (tokens.ADMIN, "admin")):
        secret = tokens.token_secret(spec, purpose, "s3cret-token")
        assert secret["metadata"]["name"] == f"{spec.name}-{name}-token"
        assert "s3cret-token" not in str(secret)  # base64 in data, as the API stores it
        assert base64.b64decode(secret["data"]["token"]).decode() == "s3cret-token"
        assert "annotations" not in secret["metadata"]


def _writable_mounts(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    volumes = {v["name"]: v for v in pod["volumes"]}
    return {
        m["mountPath"]: volumes[m["name"]]
        for m in container["volumeMounts"]
        if not m.get("readOnly")
    }


def test_worker_pods_are_hardened_with_explicit_writable_mounts() -> None:
    spec = _spec()
    pod = _pod(spec)
    (container,) = pod["containers"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == names.WORKER_UID
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["readOnlyRootFilesystem"] is True
    # Every path the engine writes is an emptyDir: tmp, the kernel/Triton/HF cache, /dev/shm.
    writable = _writable_mounts(pod, container)
    assert set(writable) == {"/tmp", names.CACHE_DIR, "/dev/shm"}
    assert all("emptyDir" in v for v in writable.values())
    assert writable["/dev/shm"]["emptyDir"]["medium"] == "Memory"
    env = _env(container)
    for var in ("GEARSHIFT_KERNEL_CACHE", "TRITON_CACHE_DIR", "HF_HOME"):
        assert env[var].startswith(names.CACHE_DIR + "/")
    # The control token: a file from the deployment's Secret, named by the env.
    assert env["GEARSHIFT_CONTROL_TOKEN_FILE"] == names.CONTROL_TOKEN_FILE
    token = next(v for v in pod["volumes"] if v["name"] == "control-token")
    assert token["secret"]["secretName"] == names.control_secret(spec.name)


def test_router_pods_are_hardened_and_read_the_token() -> None:
    spec = _spec()
    pod = _router_pod(spec)
    (container,) = pod["containers"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["runAsUser"] == names.ROUTER_UID
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert set(_writable_mounts(pod, container)) == {"/tmp"}
    assert _env(container)["GEARSHIFT_CONTROL_TOKEN_FILE"] == names.CONTROL_TOKEN_FILE


def test_vllm_workers_run_non_root_on_a_read_only_root_with_the_control_token_as_api_key() -> None:
    """Issue 31, item 7: they used to run as the image's root with a writable root filesystem
    and no API key."""
    spec = _spec("static-vllm")
    pod = _pod(spec)
    (container,) = pod["containers"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"] == {
        "seccompProfile": {"type": "RuntimeDefault"},
        "runAsNonRoot": True,
        "runAsUser": names.VLLM_UID,
        "runAsGroup": names.VLLM_UID,
        "fsGroup": names.VLLM_UID,
    }
    sc = container["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True and sc["runAsNonRoot"] is True
    # Every folder vLLM, torch, Triton and Hugging Face write is on a writable emptyDir.
    writable = _writable_mounts(pod, container)
    assert set(writable) == {"/tmp", names.CACHE_DIR, "/dev/shm"}
    assert all("emptyDir" in v for v in writable.values())
    env = _env(container)
    for var in (
        "HF_HOME",
        "VLLM_CACHE_ROOT",
        "VLLM_CONFIG_ROOT",
        "XDG_CACHE_HOME",
        "XDG_CONFIG_HOME",
        "TRITON_CACHE_DIR",
        "TORCHINDUCTOR_CACHE_DIR",
        "NUMBA_CACHE_DIR",
        "OUTLINES_CACHE_DIR",
    ):
        assert any(env[var].startswith(p + "/") for p in writable), var
    assert env["HOME"].startswith("/tmp/")
    # The API key: the deployment's control token, by reference (not in the spec, not in argv).
    key = next(e for e in container["env"] if e["name"] == "VLLM_API_KEY")
    assert key["valueFrom"]["secretKeyRef"] == {
        "name": names.control_secret(spec.name),
        "key": names.CONTROL_TOKEN_KEY,
    }
    assert container["command"] == ["vllm", "serve"]
    assert "--api-key" not in container["args"]  # argv is readable in /proc by everyone
    assert all("token" not in a for a in container["args"])
    assert "GEARSHIFT_CONTROL_TOKEN_FILE" not in env


def test_a_token_rotation_rolls_vllm_groups_only() -> None:
    """vLLM reads its key once; gearshift workers re-read the mounted token file."""
    for example, rolls in (("static-vllm", True), ("shift", False)):
        before = render_workers.stateful_set(_spec(example), 0, "cluster.local")
        body = dict(yaml.safe_load((REPO / "docs" / "examples" / f"{example}.yaml").read_text()))
        body["metadata"].update(
            namespace="ml", uid="u-1", annotations={names.ANNOTATION_TOKEN_EPOCH: "2"}
        )
        after = render_workers.stateful_set(parse(body), 0, "cluster.local")
        label = names.LABEL_REVISION
        changed = before["metadata"]["labels"][label] != after["metadata"]["labels"][label]
        assert changed is rolls, example


@pytest.mark.parametrize("drain", [30, 120])
def test_grace_period_outlasts_prestop_and_drain_and_prestop_stops_admission(drain: int) -> None:
    spec = _spec(router={"drainTimeoutSeconds": drain})
    for pod in (_pod(spec), _router_pod(spec)):
        (container,) = pod["containers"]
        assert pod["terminationGracePeriodSeconds"] >= names.PRESTOP_SECONDS + drain + 10
        script = container["lifecycle"]["preStop"]["exec"]["command"][-1]
        assert script.startswith("kill -USR1 1;")  # admission stops before SIGTERM's drain
        args = container["args"]
        assert args[args.index("--drain-timeout") + 1] == str(drain)


def _rules(policy: dict[str, Any]) -> list[dict[str, Any]]:
    return list(policy["spec"]["ingress"])


def test_worker_ports_and_rendezvous_only_from_the_group_and_the_router() -> None:
    spec = _spec()
    policy = render_network.worker_policy(spec, 1)
    group = names.group_selector(spec.name, 1)
    assert policy["spec"]["podSelector"] == {"matchLabels": group}
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]  # issue 31: egress too
    own, router = _rules(policy)
    # The group's own pods: every port (rendezvous 29500 and gloo/NCCL's own ports).
    assert own == {"from": [{"podSelector": {"matchLabels": group}}]}
    # The router: only the worker gRPC port; not the rendezvous.
    assert router["from"] == [
        {
            "podSelector": {
                "matchLabels": {names.LABEL_DEPLOYMENT: spec.name, names.LABEL_COMPONENT: "router"}
            }
        }
    ]
    assert router["ports"] == [{"protocol": "TCP", "port": names.WORKER_GRPC_PORT}]
    # No rule admits other peers (another group's pods, other namespaces).
    assert all(peer.get("namespaceSelector") is None for r in _rules(policy) for peer in r["from"])


def test_admin_only_from_the_operator_and_client_ports_as_the_user_chooses() -> None:
    spec = _spec()
    clients, admin = _rules(render_network.router_policy(spec, OPERATOR))
    assert "from" not in clients  # default: every client may reach HTTP and gRPC
    assert {p["port"] for p in clients["ports"]} == {
        names.ROUTER_HTTP_PORT,
        names.ROUTER_GRPC_PORT,
    }
    assert admin["ports"] == [{"protocol": "TCP", "port": names.ROUTER_ADMIN_PORT}]
    assert admin["from"] == [
        {
            "namespaceSelector": {
                "matchLabels": {"kubernetes.io/metadata.name": "gearshift-system"}
            },
            "podSelector": {"matchLabels": {"app.kubernetes.io/component": "operator"}},
        }
    ]
    peers = [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}]
    narrowed = _spec(router={"allowedClients": peers})
    clients, _ = _rules(render_network.router_policy(narrowed, OPERATOR))
    assert clients["from"] == peers


def test_operator_peer_comes_from_the_charts_environment() -> None:
    settings = OperatorSettings.from_env(
        {
            "GEARSHIFT_OPERATOR_NAMESPACE": "ops",
            "GEARSHIFT_OPERATOR_LABELS": "app.kubernetes.io/name=gearshift, a=b",
        }
    )
    assert settings.operator == OperatorPeer(
        "ops", {"app.kubernetes.io/name": "gearshift", "a": "b"}
    )
    with pytest.raises(ValueError, match="key=value"):
        parse_labels("novalue")


def test_protect_metrics_needs_an_api_key_and_reaches_router_json() -> None:
    with pytest.raises(SpecError, match=r"spec\.router\.protectMetrics"):
        _spec(router={"protectMetrics": True})
    spec = _spec(router={"protectMetrics": True, "apiKeySecret": {"name": "keys"}})
    assert render_config.router_config(spec, [0], "cluster.local")["protectMetrics"] is True


@pytest.mark.parametrize("name", names.RESERVED_ENV)
def test_group_env_may_not_override_what_the_operator_sets(name: str) -> None:
    with pytest.raises(SpecError, match=rf"spec\.group\.env: {name} is set by the operator") as e:
        _spec(group={"nodes": 1, "gpusPerNode": 8, "env": [{"name": name, "value": "x"}]})
    assert e.value.field == "spec.group.env"


def test_every_gearshift_variable_the_operator_renders_is_reserved() -> None:
    """So a new variable in the renderers cannot be overridden from group.env by accident."""
    for example in ("shift", "static-vllm"):
        spec = _spec(example)
        containers = [_pod(spec)["containers"][0], _router_pod(spec)["containers"][0]]
        rendered = {e["name"] for c in containers for e in c["env"]}
        ours = {n for n in rendered if n.startswith("GEARSHIFT_") or n == "VLLM_API_KEY"}
        assert ours <= set(names.RESERVED_ENV), ours - set(names.RESERVED_ENV)


def test_group_env_keeps_tunables_and_other_names() -> None:
    env = [{"name": "GEARSHIFT_HEARTBEAT_TIMEOUT", "value": "5"}, {"name": "NCCL_DEBUG"}]
    spec = _spec(group={"nodes": 1, "gpusPerNode": 8, "env": env})
    assert {"name": "NCCL_DEBUG"} in _pod(spec)["containers"][0]["env"]
    with pytest.raises(SpecError, match=r"spec\.group\.env\[0\]: needs a name"):
        _spec(group={"nodes": 1, "gpusPerNode": 8, "env": [{"value": "x"}]})
