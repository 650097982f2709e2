"""Pure parts of the operator: rendered children, revisions, rollout plans, restarts, status."""

from __future__ import annotations

import copy
import datetime as dt
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gearshift.operator.reconcile import (
    names,
    render_config,
    render_router,
    render_workers,
    restarts,
    rollout,
    status,
)
from gearshift.operator.reconcile.kube import merge_patch
from gearshift.operator.reconcile.spec import DeploymentSpec, RestartPolicy, SpecError, parse

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "docs" / "examples").glob("*.yaml"))
K8S_VERSION = kubernetes_validate.utils.latest_version()
NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def _body(name: str = "shift", **spec: Any) -> dict[str, Any]:
    body = dict(yaml.safe_load((REPO / "docs" / "examples" / f"{name}.yaml").read_text()))
    body["metadata"].update(namespace="ml", uid="u-1", generation=3)
    body["spec"].update(copy.deepcopy(spec))
    return body


def _children(spec: DeploymentSpec) -> list[dict[str, Any]]:
    out = [render_config.config_map(spec, [0], "cluster.local")]
    out += [
        render_workers.headless_service(spec, 0),
        render_workers.stateful_set(spec, 0, "cluster.local"),
    ]
    out += [render_workers.disruption_budget(spec), render_router.deployment(spec)]
    out += [render_router.service(spec), render_router.admin_service(spec)]
    return out


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_children_of_every_example_pass_kubernetes_validate(path: Path) -> None:
    spec = parse(_body(path.stem))
    for child in _children(spec):
        kubernetes_validate.validate(child, K8S_VERSION, strict=True)
        assert child["metadata"]["ownerReferences"][0]["uid"] == "u-1"
        assert child["metadata"]["labels"][names.LABEL_DEPLOYMENT] == spec.name


def _all_strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def test_worker_pods_get_the_launcher_environment_and_argument_arrays() -> None:
    # Rendering only: a group of two 4-GPU nodes (seesaw.yaml itself is one node, since its
    # host KV tier is one node's memory; the render does not check what an engine runs).
    group = {"nodes": 2, "gpusPerNode": 4, "shmSize": "320Gi"}
    spec = parse(_body("seesaw", group=group, scheduling={"gang": {"scheduler": "volcano"}}))
    sts = render_workers.stateful_set(spec, 1, "cluster.local")
    pod = sts["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert _all_strings(c["command"]) and _all_strings(c["args"])
    env = {e["name"]: e for e in c["env"]}
    assert (
        env["GEARSHIFT_GROUP_ADDR"]["value"]
        == "codellama-seesaw-g1-0.codellama-seesaw-g1.ml.svc.cluster.local"
    )
    assert (
        env["GEARSHIFT_GROUP_SIZE"]["value"] == "8"
        and env["GEARSHIFT_RANKS_PER_NODE"]["value"] == "4"
    )
    assert env["GEARSHIFT_GROUP_PORT"]["value"] == str(names.WORKER_DIST_PORT)
    assert "pod-index" in env["GEARSHIFT_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert sts["spec"]["replicas"] == 2 and sts["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert {"name": "shm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    # Volcano gang scheduling: scheduler and group annotation, plus a PodGroup of all nodes.
    assert pod["schedulerName"] == "volcano"
    assert render_workers.pod_group(spec, 1)["spec"] == {"minMember": 2}  # type: ignore[index]
    svc = render_workers.headless_service(spec, 1)
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True


def test_vllm_engine_renders_stock_vllm_serve_with_tp_pp_dp_flags() -> None:
    spec = parse(_body("static-vllm"))
    c = render_workers.stateful_set(spec, 0, "cluster.local")["spec"]["template"]["spec"][
        "containers"
    ][0]
    assert c["command"] == ["vllm", "serve"] and c["image"] == "vllm/vllm-openai:v0.11.0"
    assert c["args"] == [
        "/mnt/model/Qwen2.5-32B-Instruct",
        "--served-model-name",
        "qwen2.5-32b",
        "--tensor-parallel-size",
        "4",
        "--pipeline-parallel-size",
        "1",
        "--data-parallel-size",
        "1",
        "--dtype",
        "bfloat16",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
    ]
    router = render_config.router_config(spec, [0], "cluster.local")
    assert router["backend"] == "openai-http" and router["groups"][0]["address"].endswith(":8000")


def test_a_spec_that_slipped_past_the_crd_is_refused_naming_the_field() -> None:
    with pytest.raises(SpecError, match=r"policy\.shift"):
        parse(_body(policy={"shift": {"sp": 3, "tp": 2}}))
    with pytest.raises(SpecError, match=r"spec\.policy"):
        parse(_body(policy={"bogus": {}}))


def test_revision_ignores_live_fields_and_follows_layout_and_image() -> None:
    def rev(**spec: Any) -> str:
        return render_workers.stateful_set(parse(_body(**spec)), 0, "cluster.local")["metadata"][
            "labels"
        ][names.LABEL_REVISION]

    base = rev()
    assert rev(policy={"shift": {"sp": 4, "tp": 2, "threshold": 4096}}) == base
    assert rev(policy={"shift": {"sp": 2, "tp": 4, "threshold": 256}}) != base
    assert rev(images={"worker": "w:2", "router": "r:1"}) != base
    assert rev(replicas=7) == base


def _group(
    i: int, current: bool = True, available: bool = True, surge: bool = False
) -> rollout.ObservedGroup:
    return rollout.ObservedGroup(i, "new" if current else "old", "new", available, surge)


def test_rollout_creates_missing_groups_and_deletes_extra_ones() -> None:
    plan = rollout.plan([_group(0), _group(3)], replicas=2, max_unavailable=1, max_surge=0)
    assert plan.create == [1] and plan.delete == [3] and not plan.roll


def test_rollout_keeps_max_unavailable_and_rolls_unavailable_groups_first() -> None:
    groups = [
        _group(0, current=False),
        _group(1, current=False, available=False),
        _group(2, current=False),
    ]
    assert rollout.plan(groups, 3, max_unavailable=1, max_surge=0).roll == [1]
    groups = [_group(0, current=False), _group(1, current=False), _group(2, current=False)]
    assert rollout.plan(groups, 3, max_unavailable=1, max_surge=0).roll == [0]
    assert rollout.plan(groups, 3, max_unavailable=2, max_surge=0).roll == [0, 1]
    rolling = [
        _group(0, current=True, available=False),
        _group(1, current=False),
        _group(2, current=False),
    ]
    assert rollout.plan(rolling, 3, max_unavailable=1, max_surge=0).idle


def test_rollout_with_surge_adds_a_new_group_before_taking_an_old_one_down() -> None:
    groups = [_group(0, current=False), _group(1, current=False)]
    first = rollout.plan(groups, 2, max_unavailable=0, max_surge=1)
    assert first.create_surge == [2] and not first.roll
    second = rollout.plan([*groups, _group(2, surge=True)], 2, max_unavailable=0, max_surge=1)
    assert second.roll == [0]
    done = rollout.plan(
        [_group(0), _group(1), _group(2, surge=True)], 2, max_unavailable=0, max_surge=1
    )
    assert done.delete == [2]


def test_rollout_keeps_the_surge_group_until_the_rolled_group_serves() -> None:
    # The last old group was rolled: it is current but restarting. The surge group serves in
    # its place, so it stays until the rolled group serves.
    rolled = [_group(0, available=False), _group(1, surge=True)]
    assert rollout.plan(rolled, 1, max_unavailable=0, max_surge=1).idle
    served = [_group(0), _group(1, surge=True)]
    assert rollout.plan(served, 1, max_unavailable=0, max_surge=1).delete == [1]
    # A new base group alone (the first deployment) gets no surge group.
    assert rollout.plan([_group(0, available=False)], 1, max_unavailable=0, max_surge=1).idle


@pytest.mark.parametrize("replicas", [1, 2, 3, 5])
@pytest.mark.parametrize("second_change_at", [None, 1, 2, 3, 4])
def test_a_surge_rollout_never_serves_fewer_groups_than_replicas(
    replicas: int, second_change_at: int | None
) -> None:
    """Passes of rollout.plan (maxUnavailable 0, maxSurge 1) over a model of the groups: a group
    created or rolled serves two passes later; a second layout change may arrive mid-roll."""
    groups = {i: ["A", True, False] for i in range(replicas)}  # revision, serving, surge
    desired, starting = "B", {}
    fewest = replicas
    for t in range(80):
        if t == second_change_at:
            desired = "C"
        seen = [rollout.ObservedGroup(i, g[0], desired, g[1], g[2]) for i, g in groups.items()]
        step = rollout.plan(seen, replicas, max_unavailable=0, max_surge=1)
        for i in step.create + step.create_surge:
            groups[i], starting[i] = [desired, False, i >= replicas], 2
        for i in step.roll:
            groups[i][:2], starting[i] = [desired, False], 2
        for i in step.delete:
            groups.pop(i)
            starting.pop(i, None)
        fewest = min(fewest, sum(g[1] for g in groups.values()))
        for i in list(starting):
            starting[i] -= 1
            if not starting[i]:
                groups[i][1] = True
                del starting[i]
        if step.idle and not starting and len(groups) == replicas:
            break
    assert fewest >= replicas
    assert sorted(groups) == list(range(replicas))
    assert all(g[0] == desired and g[1] for g in groups.values())


def _pod(
    name: str, restarts_: int = 0, phase: str = "Running", waiting: str = ""
) -> dict[str, Any]:
    cs: dict[str, Any] = {"name": "worker", "restartCount": restarts_}
    if waiting:
        cs["state"] = {"waiting": {"reason": waiting}}
    return {"metadata": {"name": name}, "status": {"phase": phase, "containerStatuses": [cs]}}


def test_restart_decisions_back_off_and_give_up() -> None:
    policy = RestartPolicy(backoff_seconds=10, max_backoff_seconds=300, max_restarts=3)
    healthy = [_pod("a"), _pod("b")]
    crashed = [_pod("a"), _pod("b", restarts_=1)]
    fresh = restarts.GroupRestartState()
    assert restarts.decide(healthy, fresh, policy, NOW).action == "none"
    assert restarts.decide(crashed, fresh, policy, NOW).action == "restart"
    once = restarts.GroupRestartState(1, NOW - dt.timedelta(seconds=5))
    waiting = restarts.decide(crashed, once, policy, NOW)
    assert waiting.action == "wait" and waiting.wait_seconds == pytest.approx(5)
    twice = restarts.GroupRestartState(2, NOW - dt.timedelta(seconds=15))
    assert restarts.decide(crashed, twice, policy, NOW).action == "wait"  # 20 s after the 2nd
    assert (
        restarts.decide(crashed, restarts.GroupRestartState(3, NOW), policy, NOW).action
        == "give-up"
    )
    assert restarts.decide([_pod("a", phase="Failed")], fresh, policy, NOW).action == "restart"
    assert (
        restarts.decide([_pod("a", waiting="ImagePullBackOff")], fresh, policy, NOW).action
        == "none"
    )
    off = RestartPolicy(type="None")
    assert restarts.decide(crashed, fresh, off, NOW).action == "none"


def _build(groups: list[status.GroupReport], router_error: str = "", **kw: Any) -> dict[str, Any]:
    result = status.PassResult(
        replicas=2, max_unavailable=1, groups=groups, router_error=router_error, **kw
    )
    return status.build(
        result,
        name="x",
        policy_kind="shift",
        endpoint="http://x",
        generation=4,
        previous={},
        now=NOW,
    )


def _cond(st: dict[str, Any], type_: str) -> tuple[str, str]:
    c = next(c for c in st["conditions"] if c["type"] == type_)
    return c["status"], c["reason"]


def test_ready_needs_the_router_to_report_groups_serving() -> None:
    not_serving = [
        status.GroupReport("x-g0", 0, ready=False),
        status.GroupReport("x-g1", 1, ready=False),
    ]
    st = _build(not_serving)
    assert _cond(st, "Ready") == ("False", "GroupsNotServing")
    assert _cond(st, "Progressing") == ("True", "WaitingForGroups")
    assert _cond(_build(not_serving, router_error="UNAVAILABLE"), "Ready") == (
        "False",
        "RouterUnavailable",
    )
    serving = [
        status.GroupReport("x-g0", 0, ready=True, gear="base"),
        status.GroupReport("x-g1", 1, ready=True, gear="base"),
    ]
    st = _build(serving)
    assert _cond(st, "Ready") == ("True", "Serving") and _cond(st, "Progressing") == (
        "False",
        "Complete",
    )
    assert st["readyGroups"] == "2/2" and st["gear"] == "base" and st["observedGeneration"] == 4
    assert st["selector"] == names.scale_selector("x")
    assert _cond(_build(serving, gave_up=["x-g0: crash"]), "Degraded") == (
        "True",
        "GroupRestartLimit",
    )


def test_condition_transition_time_moves_only_when_status_flips() -> None:
    before = [{"type": "Ready", "status": "True", "lastTransitionTime": "2025-01-01T00:00:00Z"}]
    same = status.condition(before, "Ready", True, "Serving", "", NOW, 1)
    flipped = status.condition(before, "Ready", False, "GroupsNotServing", "", NOW, 1)
    assert same["lastTransitionTime"] == "2025-01-01T00:00:00Z"
    assert flipped["lastTransitionTime"] == "2026-01-01T00:00:00Z"


def test_merge_patch_removes_what_the_operator_stopped_setting() -> None:
    last = {"metadata": {"labels": {"a": "1", "old": "x"}}, "spec": {"x": 1, "gone": True}}
    desired = {"metadata": {"labels": {"a": "2"}}, "spec": {"x": 1}}
    assert merge_patch(last, desired) == {
        "metadata": {"labels": {"a": "2", "old": None}},
        "spec": {"x": 1, "gone": None},
    }


def test_attention_backend_reaches_engine_json_and_a_change_restarts_the_groups() -> None:
    import json

    from gearshift.operator.reconcile import spec as spec_mod
    from gearshift.worker.config import ATTENTION_BACKENDS

    assert spec_mod.ATTENTION_BACKENDS == ATTENTION_BACKENDS  # the worker's, without torch
    model = {"source": "/models/m", "attentionBackend": "triton"}
    spec = parse(_body(model=model))
    engine = json.loads(render_config.config_map(spec, [0], "cluster.local")["data"]["engine.json"])
    assert engine["model"]["attentionBackend"] == "triton"
    # auto (the default) is left out: the worker's default, and revisions of older specs hold.
    plain = render_config.engine_config(parse(_body(model={"source": "/models/m"})))
    assert "attentionBackend" not in plain["model"]

    def rev(backend: str) -> str:
        body = _body(model={"source": "/models/m", "attentionBackend": backend})
        labels = render_workers.stateful_set(parse(body), 0, "cluster.local")["metadata"]["labels"]
        return str(labels[names.LABEL_REVISION])

    assert rev("triton") != rev("torch")
    with pytest.raises(SpecError, match=r"spec\.model\.attentionBackend: must be one of"):
        parse(_body(model={"source": "/models/m", "attentionBackend": "flash"}))
    vllm = _body("static-vllm")
    vllm["spec"]["model"]["attentionBackend"] = "triton"
    with pytest.raises(SpecError, match=r"spec\.model\.attentionBackend: engine vllm"):
        parse(vllm)
