"""hf:// sources as pods: the fetch-model init container (worker and router), its token, cache
volume and pinned revision; the rendered command run for real against a local Hub; pvc:// and
path sources unchanged; hub-only fields refused on other sources."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from crd_validation import validate

from gearshift.operator.reconcile import names, render_config, render_router, render_workers
from gearshift.operator.reconcile.spec import DeploymentSpec, SpecError, parse
from tests.worker.helpers import make_hf_checkpoint
from tests.worker.model.hub_server import HubServer, Repo

REPO = Path(__file__).resolve().parents[2]
K8S_VERSION = kubernetes_validate.utils.latest_version()
SHA = "0123456789abcdef0123456789abcdef01234567"
HF_MODEL = {
    "source": "hf://org/tiny",
    "name": "tiny",
    "revision": SHA,
    "hfTokenSecret": {"name": "hf-token"},
    "cache": {"claimName": "model-cache"},
}


def _body(example: str, **model: Any) -> dict[str, Any]:
    body = dict(yaml.safe_load((REPO / "docs" / "examples" / f"{example}.yaml").read_text()))
    body["metadata"].update(namespace="ml", uid="u-1", generation=1)
    body["spec"]["model"] = copy.deepcopy(model)
    return body


def _pod(spec: DeploymentSpec) -> dict[str, Any]:
    return dict(render_workers.stateful_set(spec, 0, "cluster.local")["spec"]["template"]["spec"])


def _router_pod(spec: DeploymentSpec) -> dict[str, Any]:
    return dict(render_router.deployment(spec)["spec"]["template"]["spec"])


@pytest.mark.parametrize("example", ["static", "static-vllm"])
def test_hf_source_downloads_in_an_init_container_before_the_server(example: str) -> None:
    spec = parse(_body(example, **HF_MODEL))
    dest = f"{names.HF_MOUNT}/org--tiny--{SHA}"
    assert render_config.model_path(spec) == dest
    pod = _pod(spec)
    (init,) = pod["initContainers"]
    assert init["command"] == ["gearshift"]
    assert init["args"] == ["fetch-model", "hf://org/tiny", "--dest", dest, "--revision", SHA]
    assert init["image"] == spec.images.router
    token = next(e for e in init["env"] if e["name"] == "HF_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "HF_TOKEN"}
    assert init["volumeMounts"] == [{"name": "model", "mountPath": names.HF_MOUNT}]
    assert init["securityContext"]["readOnlyRootFilesystem"] is True
    model_volume = next(v for v in pod["volumes"] if v["name"] == "model")
    assert model_volume["persistentVolumeClaim"] == {"claimName": "model-cache"}
    server = pod["containers"][0]
    assert {"name": "model", "mountPath": names.HF_MOUNT, "readOnly": True} in server[
        "volumeMounts"
    ]
    if example == "static-vllm":
        assert server["args"][0] == dest  # vllm serve reads the downloaded folder
    else:
        assert render_config.engine_config(spec)["model"]["path"] == dest
    assert render_config.router_config(spec, [0], "cluster.local")["model"]["path"] == dest
    for child in (
        render_workers.stateful_set(spec, 0, "cluster.local"),
        render_router.deployment(spec),
    ):
        kubernetes_validate.validate(child, K8S_VERSION, strict=True)


def test_the_router_fetches_only_the_tokenizer_into_its_own_empty_dir() -> None:
    spec = parse(_body("static", **HF_MODEL))
    pod = _router_pod(spec)
    (init,) = pod["initContainers"]
    assert init["args"][-1] == "--tokenizer-only"
    assert next(v for v in pod["volumes"] if v["name"] == "model") == {
        "name": "model",
        "emptyDir": {},
    }
    mounts = pod["containers"][0]["volumeMounts"]
    assert {"name": "model", "mountPath": names.HF_MOUNT, "readOnly": True} in mounts


def test_without_cache_or_token_each_pod_downloads_the_default_branch_anonymously() -> None:
    spec = parse(_body("static", source="hf://org/tiny"))
    pod = _pod(spec)
    (init,) = pod["initContainers"]
    assert "--revision" not in init["args"]
    assert init["args"][3] == f"{names.HF_MOUNT}/org--tiny--main"
    assert all(e["name"] != "HF_TOKEN" for e in init["env"])
    assert {"name": "model", "emptyDir": {}} in pod["volumes"]


def test_pvc_and_image_path_sources_render_no_init_container() -> None:
    spec = parse(_body("static", source="pvc://models/llama"))
    pod = _pod(spec)
    assert "initContainers" not in pod and "initContainers" not in _router_pod(spec)
    assert {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "models", "readOnly": True},
    } in pod["volumes"]
    assert render_config.model_path(spec) == f"{names.PVC_MOUNT}/llama"
    spec = parse(_body("static", source="/models/llama"))
    pod = _pod(spec)
    assert "initContainers" not in pod and all(v["name"] != "model" for v in pod["volumes"])
    assert render_config.model_path(spec) == "/models/llama"


@pytest.mark.parametrize("field", ["revision", "hfTokenSecret", "cache"])
def test_hub_fields_on_other_sources_are_refused_by_the_crd_and_the_operator(field: str) -> None:
    crd = yaml.safe_load((REPO / "crds" / "inferencedeployments.gearshift.dev.yaml").read_text())
    body = _body("static", source="pvc://models/llama", **{field: HF_MODEL[field]})
    errors = validate(crd, body)
    assert any("apply to hf:// sources only" in e for e in errors), errors
    with pytest.raises(SpecError, match=r"spec\.model: .*hf:// sources only"):
        parse(body)
    assert validate(crd, _body("static", **HF_MODEL)) == []


@pytest.mark.slow
def test_the_rendered_init_command_downloads_from_a_hub(tmp_path: Path) -> None:
    """The init container's own command line, run here: only the mount is moved to tmp."""
    model = make_hf_checkpoint(tmp_path / "src", "smollm-tied")
    files = {p.name: p.read_bytes() for p in model.iterdir() if p.is_file()}
    files["tokenizer.json"] = b"{}"  # check_folder wants a tokenizer; not parsed here
    with HubServer(token="secret") as hub:
        repo = Repo()
        sha = repo.add_commit(files, "main")
        hub.repos["org/tiny"] = repo
        spec = parse(_body("static", **{**HF_MODEL, "revision": sha}))
        init = _pod(spec)["initContainers"][0]
        mount = tmp_path / "mnt"
        args = [a.replace(names.HF_MOUNT, str(mount)) for a in init["args"]]
        env = {
            e["name"]: e["value"].replace(names.HF_MOUNT, str(mount))
            for e in init["env"]
            if "value" in e
        }
        env |= {"HF_TOKEN": "secret", "HF_ENDPOINT": hub.url, "PATH": os.environ["PATH"]}
        done = subprocess.run(
            [sys.executable, "-m", "gearshift.operator.cli", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
    dest = Path(args[args.index("--dest") + 1])
    assert dest.parent == mount
    assert (dest / "model.safetensors").read_bytes() == files["model.safetensors"]


@pytest.mark.parametrize(
    "revision", ["../../etc", "refs/pr/1", "v1..2", ".hidden", "a b", "main\n"]
)
def test_a_revision_that_is_a_path_is_refused_by_the_crd_and_the_operator(revision: str) -> None:
    crd = yaml.safe_load((REPO / "crds" / "inferencedeployments.gearshift.dev.yaml").read_text())
    body = _body("static", **{**HF_MODEL, "revision": revision})
    if not revision.endswith("\n"):  # Python's `$` passes a final newline; the API server's RE2
        assert any("model.revision" in e for e in validate(crd, body))
    with pytest.raises(SpecError, match=r"spec\.model\.revision .*no '/', no '\.\.'") as e:
        parse(body)
    assert e.value.field == "spec.model.revision"


@pytest.mark.parametrize("revision", ["main", "v1.2.0", "release-2024_06", SHA])
def test_commits_tags_and_branch_names_are_accepted(revision: str) -> None:
    crd = yaml.safe_load((REPO / "crds" / "inferencedeployments.gearshift.dev.yaml").read_text())
    body = _body("static", **{**HF_MODEL, "revision": revision})
    assert validate(crd, body) == []
    assert parse(body).model.revision == revision
