"""Issue 31 under the real operator (kopf against kmock). Tokens (items 2, 4): two Secrets
(admin, control) written without any annotation, no Secret data in any annotation of anything
the operator wrote, a Secret of someone else's never overwritten, a legacy Secret's leaked
annotation removed, a rotation through the token-epoch annotation. Inputs (items 3, 8): a
reserved env name is InvalidSpec for clusters without CEL."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kmock_harness import Api, OperatorProcess, StandInAdmin, condition, cr_metadata, wait_for

from gearshift.operator.reconcile import names, tokens
from gearshift.operator.reconcile.reconciler import SNAPSHOT_KINDS
from gearshift.operator.reconcile.spec import parse
from tests.worker.model.hub_server import HubServer, Repo

NS = "tok"
SECRETS = f"/api/v1/namespaces/{NS}/secrets"
CR_PATH = f"/apis/{names.GROUP}/{names.VERSION}/namespaces/{NS}/{names.PLURAL}"


def _resource(repo: Path, name: str) -> dict[str, Any]:
    body = yaml.safe_load((repo / "docs/examples/static.yaml").read_text())
    body["metadata"] = cr_metadata(name, NS)
    return dict(body)


def _secret(api: Api, name: str) -> dict[str, Any] | None:
    return api.get(f"{SECRETS}/{name}")


def _token(secret: dict[str, Any] | None) -> str:
    assert secret is not None
    return base64.b64decode(secret["data"][names.CONTROL_TOKEN_KEY]).decode()


def _everything(api: Api, name: str) -> list[dict[str, Any]]:
    """Every object of the deployment the operator may have written, and the resource."""
    out = [api.cr(NS, name) or {}]
    for api_version, kind in [*SNAPSHOT_KINDS, ("v1", "Secret")]:
        prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        plural = {"NetworkPolicy": "networkpolicies", "PodDisruptionBudget": "poddisruptionbudgets"}
        path = f"{prefix}/namespaces/{NS}/{plural.get(kind, kind.lower() + 's')}"
        out += api.items(path, {names.LABEL_DEPLOYMENT: name})
    return out


@pytest.fixture(autouse=True)
def _one_deployment_at_a_time(api: Api, operator_process: OperatorProcess) -> Iterator[None]:
    assert operator_process.alive(), operator_process.log.read_text()[-3000:]
    yield
    api.delete_all_crs(NS)


def test_two_token_secrets_and_no_secret_data_in_any_annotation(
    api: Api, admin: StandInAdmin, operator_process: OperatorProcess, repo: Path
) -> None:
    name = "annot"
    api.create_cr(NS, _resource(repo, name))
    wait_for(lambda: api.get(f"/apis/apps/v1/namespaces/{NS}/statefulsets/{name}-g0"), 30, "sts")
    admin_secret = _secret(api, names.admin_secret(name))
    control_secret = _secret(api, names.control_secret(name))
    admin_token, control_token = _token(admin_secret), _token(control_secret)
    assert admin_token != control_token and min(len(admin_token), len(control_token)) >= 32
    wait_for(lambda: f"Bearer {admin_token}" in admin.authorization, 30, "Admin called")
    assert f"Bearer {control_token}" not in admin.authorization  # Admin gets its own token
    secrets_data = set()
    for secret in (admin_secret, control_secret):
        assert secret is not None
        assert not secret["metadata"].get("annotations")
        assert secret["metadata"]["labels"][names.LABEL_MANAGED_BY] == names.MANAGED_BY
        assert secret["metadata"]["ownerReferences"][0]["uid"] == f"uid-{name}"
        secrets_data |= {_token(secret), secret["data"][names.CONTROL_TOKEN_KEY]}
    # The pass that created the StatefulSet (and called Admin at its start) writes the router's
    # Deployment after it: wait for the whole pass, not its first objects.
    wanted = {"StatefulSet", "Deployment", "Secret"}
    wait_for(lambda: {o.get("kind") for o in _everything(api, name)} >= wanted, 30, "every kind")
    objects = _everything(api, name)
    for obj in objects:
        annotations = json.dumps((obj.get("metadata") or {}).get("annotations") or {})
        leaked = [d for d in secrets_data if d in annotations]
        assert not leaked, f"{obj['kind']} {obj['metadata']['name']} carries Secret data"
    # Where the tokens go: worker pods mount the control token only, the router both.
    sts = api.get(f"/apis/apps/v1/namespaces/{NS}/statefulsets/{name}-g0")
    router = api.get(f"/apis/apps/v1/namespaces/{NS}/deployments/{name}-router")
    assert sts is not None and router is not None
    secret_volumes = {
        kind: {
            v["secret"]["secretName"]
            for v in obj["spec"]["template"]["spec"]["volumes"]
            if "secret" in v
        }
        for kind, obj in (("worker", sts), ("router", router))
    }
    assert secret_volumes == {
        "worker": {names.control_secret(name)},
        "router": {names.control_secret(name), names.admin_secret(name)},
    }


def test_a_secret_of_someone_else_under_the_token_name_is_refused_not_overwritten(
    api: Api, operator_process: OperatorProcess, repo: Path
) -> None:
    name = "clash"
    theirs = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": names.admin_secret(name), "namespace": NS, "labels": {"app": "x"}},
        "data": {"token": base64.b64encode(b"their-password").decode()},
    }
    code, data = api.call("POST", SECRETS, theirs)
    assert code in (200, 201), data
    try:
        api.create_cr(NS, _resource(repo, name))
        invalid = wait_for(
            lambda: (c := condition(api.cr(NS, name), "InvalidSpec")).get("status") == "True" and c,
            30,
            "InvalidSpec naming the Secret",
        )
        assert names.admin_secret(name) in invalid["message"]
        assert _token(_secret(api, names.admin_secret(name))) == "their-password"
        assert not api.get(f"/apis/apps/v1/namespaces/{NS}/statefulsets/{name}-g0")
    finally:
        api.call("DELETE", f"{SECRETS}/{names.admin_secret(name)}")


def test_a_legacy_token_secret_loses_its_leaked_annotation(
    api: Api, operator_process: OperatorProcess, repo: Path
) -> None:
    """Older operators applied the Secret like any child, copying the token into its
    last-applied annotation; the first pass now rewrites it without one."""
    name = "legacy"
    body = _resource(repo, name)
    old = tokens.token_secret(parse(body), tokens.CONTROL, "leaked-old-token")
    old["metadata"]["annotations"] = {names.ANNOTATION_APPLIED: json.dumps(old)}
    code, data = api.call("POST", SECRETS, old)
    assert code in (200, 201), data
    api.create_cr(NS, body)

    wait_for(
        lambda: _token(_secret(api, names.control_secret(name))) != "leaked-old-token",
        30,
        "the legacy Secret rewritten",
    )
    secret = _secret(api, names.control_secret(name))
    assert secret is not None and not secret["metadata"].get("annotations")
    leaked = base64.b64encode(b"leaked-old-token").decode()
    assert "leaked-old-token" not in json.dumps(secret) and leaked not in json.dumps(secret)


def test_a_new_token_epoch_rotates_both_tokens_and_the_operator_presents_both_admin_tokens(
    api: Api, admin: StandInAdmin, operator_process: OperatorProcess, repo: Path
) -> None:
    name = "rotate"
    api.create_cr(NS, _resource(repo, name))
    wait_for(lambda: _secret(api, names.admin_secret(name)), 30, "admin Secret")
    old_admin = _token(_secret(api, names.admin_secret(name)))
    old_control = _token(_secret(api, names.control_secret(name)))
    wait_for(lambda: f"Bearer {old_admin}" in admin.authorization, 30, "Admin called")
    patch = {"metadata": {"annotations": {names.ANNOTATION_TOKEN_EPOCH: "2024-06"}}}
    code, data = api.call("PATCH", f"{CR_PATH}/{name}", patch)
    assert code == 200, data
    wait_for(
        lambda: _token(_secret(api, names.admin_secret(name))) != old_admin, 30, "new admin token"
    )
    new_admin = _token(_secret(api, names.admin_secret(name)))
    assert _token(_secret(api, names.control_secret(name))) != old_control
    # A router that still holds the old token (kubelet not there yet) keeps admitting the
    # operator: within the grace window it presents the new token and the old one.
    admin.authorization.clear()
    wait_for(lambda: f"Bearer {new_admin}" in admin.authorization, 30, "new token presented")
    assert f"Bearer {old_admin}" in admin.authorization
    assert condition(api.cr(NS, name), "InvalidSpec").get("status") != "True"
    # Later passes change nothing: the tokens are derived from the epoch, not drawn anew.
    wait_for(lambda: len(admin.authorization) > 10, 30, "more passes")
    assert _token(_secret(api, names.admin_secret(name))) == new_admin


def test_a_reserved_env_name_is_invalid_spec_and_renders_nothing(
    api: Api, operator_process: OperatorProcess, repo: Path
) -> None:
    """What the CRD's CEL rule refuses, for an API server that runs no CEL (or a resource
    stored before the rule existed)."""
    name = "envy"
    body = _resource(repo, name)
    body["spec"]["group"]["env"] = [
        {"name": "GEARSHIFT_HEARTBEAT_TIMEOUT", "value": "5"},  # a tunable: allowed
        {"name": "GEARSHIFT_CONTROL_TOKEN_FILE", "value": "/dev/null"},
    ]
    api.create_cr(NS, body)
    invalid = wait_for(
        lambda: (c := condition(api.cr(NS, name), "InvalidSpec")).get("status") == "True" and c,
        30,
        "InvalidSpec",
    )
    assert (
        "spec.group.env: GEARSHIFT_CONTROL_TOKEN_FILE is set by the operator"
        in (invalid["message"])
    )
    assert not api.get(f"/apis/apps/v1/namespaces/{NS}/statefulsets/{name}-g0")
    assert not _secret(api, names.admin_secret(name))  # refused before any token is written


def _init_revisions(api: Api, name: str) -> set[str]:
    """The --revision of every init container of the deployment's pod templates."""
    templates = [
        o["spec"]["template"]["spec"]
        for o in api.items(f"/apis/apps/v1/namespaces/{NS}/statefulsets")
        + api.items(f"/apis/apps/v1/namespaces/{NS}/deployments")
        if o["metadata"]["labels"].get(names.LABEL_DEPLOYMENT) == name
    ]
    out = set()
    for pod in templates:
        (init,) = pod["initContainers"]
        out.add(init["args"][init["args"].index("--revision") + 1])
    return out


def test_an_hf_branch_is_pinned_once_for_every_pod_and_moves_only_with_the_spec(
    api: Api, admin: StandInAdmin, hub: HubServer, operator_process: OperatorProcess, repo: Path
) -> None:
    name = "pinned"
    hub_repo = hub.repos.setdefault("org/pinme", Repo())
    first = hub_repo.add_commit({"config.json": b"1"}, "main")
    body = _resource(repo, name)
    body["spec"]["model"] = {"source": "hf://org/pinme", "name": "pinme"}
    api.create_cr(NS, body)
    model = wait_for(lambda: (api.cr(NS, name) or {}).get("status", {}).get("model"), 30, "pin")
    assert model == {"source": "hf://org/pinme", "revision": "main", "commit": first}
    wait_for(lambda: len(api.names(f"/apis/apps/v1/namespaces/{NS}/statefulsets")) >= 3, 30, "")
    assert _init_revisions(api, name) == {first}  # 3 groups and the router: one commit

    # main moves on the Hub: the deployment stays on its commit (no pod is rolled).
    second = hub_repo.add_commit({"config.json": b"2"}, "main", "v2")
    calls = len(admin.authorization)  # one GetStatus per pass
    wait_for(lambda: len(admin.authorization) >= calls + 5, 30, "more passes")
    assert (api.cr(NS, name) or {})["status"]["model"]["commit"] == first
    assert _init_revisions(api, name) == {first}

    # The spec asks for another revision: pinned afresh, then every pod template follows.
    api.patch_spec(NS, name, {"model": {"source": "hf://org/pinme", "revision": "v2"}})
    wait_for(lambda: (api.cr(NS, name) or {})["status"]["model"]["commit"] == second, 30, "new pin")
    assert (api.cr(NS, name) or {})["status"]["model"]["revision"] == "v2"

    # A revision the Hub does not know: refused naming the field, the pin kept.
    api.patch_spec(NS, name, {"model": {"source": "hf://org/pinme", "revision": "nope"}})
    invalid = wait_for(
        lambda: (c := condition(api.cr(NS, name), "InvalidSpec")).get("status") == "True" and c,
        30,
        "InvalidSpec",
    )
    assert invalid["reason"] == "SpecModelRevision" and "'nope'" in invalid["message"]
    assert (api.cr(NS, name) or {})["status"]["model"]["commit"] == second
