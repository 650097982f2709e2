"""``spec.policy.auto.calibrate`` in the reconcile pass (issue 30, item 1): make sure the
calibration's objects exist (calibration.py) and carry this deployment as an owner, then read its
ConfigMap: the profile once the Job wrote it, the Job's failure, or still calibrating.

While it calibrates the plan waits (it does not plan from the preset meanwhile: that plan would
be replaced minutes later, rolling the groups twice): a deployment with nothing running yet
renders nothing, with reason ``Calibrating``; one already running keeps its running choice.

A calibration a deployment no longer uses (another key, ``calibrate`` off, not ``auto``, deleted)
is let go (``retire``): its owner reference goes, and a calibration nobody references is deleted,
a running Job with its pod.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from gearshift.operator.reconcile import calibration, names, restarts
from gearshift.operator.reconcile import calibration_retry as retry
from gearshift.operator.reconcile.kube import Kube, KubeError
from gearshift.operator.reconcile.spec import DeploymentSpec, SpecError
from gearshift.operator.sim import auto_policy
from gearshift.operator.sim import hardware as hw_mod

FIELD = calibration.FIELD


@dataclass(frozen=True)
class Measured:
    config_map: str  # where the profile is
    text: str


@dataclass(frozen=True)
class Calibrating:
    job: str
    message: str


def product_of(spec: DeploymentSpec, gpu: str, nodes: list[dict[str, Any]]) -> str:
    """The ``nvidia.com/gpu.product`` value of a node the group may run on with a ``gpu`` GPU
    (the first in sorted order when several forms of it are labelled); SpecError if none."""
    selector = spec.scheduling.node_selector
    found = set()
    for n in nodes:
        labels = (n.get("metadata") or {}).get("labels") or {}
        if all(labels.get(k) == v for k, v in selector.items()):
            product = labels.get(calibration.GPU_LABEL, "")
            if product and hw_mod.preset_of_product(product) == gpu.upper():
                found.add(product)
    if not found:
        where = f" matching spec.scheduling.nodeSelector {selector}" if selector else ""
        raise SpecError(
            f"{FIELD}: no node{where} carries a {gpu} GPU ({calibration.GPU_LABEL}) to profile on",
            FIELD,
        )
    return sorted(found)[0]


async def _ensure(kube: Kube, spec: DeploymentSpec, manifest: dict[str, Any]) -> dict[str, Any]:
    """The object as it is, created if missing, with ``spec`` among its owners."""
    meta = manifest["metadata"]
    api_version, kind = manifest["apiVersion"], manifest["kind"]
    current = await kube.get(api_version, kind, spec.namespace, meta["name"])
    if current is None:
        await kube.create(manifest)  # False: created meanwhile by another pass
        current = await kube.get(api_version, kind, spec.namespace, meta["name"])
        if current is None:
            raise KubeError(404, f"{kind} {meta['name']} vanished after its creation")
        return current
    refs = (current.get("metadata") or {}).get("ownerReferences") or []
    if not any(r.get("uid") == spec.uid for r in refs):
        ref = calibration.owner(spec)
        op: dict[str, Any] = {"op": "add", "path": "/metadata/ownerReferences/-", "value": ref}
        if not refs:
            op = {"op": "add", "path": "/metadata/ownerReferences", "value": [ref]}
        ops = [op]
        await kube.json_patch(api_version, kind, spec.namespace, meta["name"], ops)
    return current


def _done(job: dict[str, Any]) -> bool:
    conditions = (job.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Complete" and c.get("status") == "True" for c in conditions)


def _failed(job: dict[str, Any]) -> str | None:
    for c in (job.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Failed" and c.get("status") == "True":
            return f"{c.get('reason') or 'Failed'}: {c.get('message') or 'no message'}"
    return None


async def run(
    kube: Kube,
    spec: DeploymentSpec,
    gpu: str,
    nodes: list[dict[str, Any]],
    now: dt.datetime,
    rules: retry.CalibrationRetry,
) -> Measured | Calibrating:
    """The calibration of ``spec`` on ``gpu``: measured, or still running (a failed Job waits
    for its next attempt: calibration_retry.py); SpecError naming spec.policy.auto.calibrate
    when it cannot run or its last attempt failed."""
    calibration.check(spec)
    key = calibration.key(spec, gpu)
    name = calibration.name_of(key)
    product = product_of(spec, gpu, nodes)
    try:
        # The Job is ensured last: once it names this deployment as an owner, so do the rest,
        # and a pass needs only the Job and the ConfigMap (two GETs, not five).
        job = await kube.get("batch/v1", "Job", spec.namespace, name)
        owned = job is not None and any(
            r.get("uid") == spec.uid for r in job["metadata"].get("ownerReferences") or []
        )
        result = await kube.get("v1", "ConfigMap", spec.namespace, name) if owned else None
        if job is not None and result is not None:
            objects = {"Job": job, "ConfigMap": result}
        else:
            objects = {
                m["kind"]: await _ensure(kube, spec, m)
                for m in calibration.manifests(spec, gpu, product, key)
            }
    except KubeError as exc:
        raise SpecError(f"{FIELD}: cannot create the calibration's objects ({exc})", FIELD) from exc
    text = (objects["ConfigMap"].get("data") or {}).get(auto_policy.PROFILE_KEY)
    if text:
        return Measured(name, str(text))
    failed = _failed(objects["Job"])
    if failed is None and _done(objects["Job"]):
        failed = f"Complete, yet ConfigMap {name} holds no {auto_policy.PROFILE_KEY}"
    annotations = (objects["ConfigMap"].get("metadata") or {}).get("annotations") or {}
    attempt = int(annotations.get(retry.ATTEMPT_ANNOTATION) or 1)
    of = f"attempt {attempt} of {rules.attempts}"
    if failed is not None:
        try:
            fresh = calibration.job(spec, gpu, product, key)
            return await _after_failure(kube, spec, objects, fresh, failed, attempt, now, rules)
        except KubeError as exc:
            raise SpecError(f"{FIELD}: cannot retry the Job {name} ({exc})", FIELD) from exc
    layouts = ", ".join(calibration.layouts(spec.group.ranks))
    return Calibrating(
        name,
        f"{FIELD}: Job {name} ({of}) profiles {layouts} on a {product} node; the plan waits "
        f"for its profile (ConfigMap {name})",
    )


async def _after_failure(
    kube: Kube,
    spec: DeploymentSpec,
    objects: dict[str, dict[str, Any]],
    fresh: dict[str, Any],
    failed: str,
    attempt: int,
    now: dt.datetime,
    rules: retry.CalibrationRetry,
) -> Calibrating:
    """A failed Job: its next attempt waits, starts now, or there is none (SpecError)."""
    job, config_map = objects["Job"], objects["ConfigMap"]
    meta = job["metadata"]
    name, uid = meta["name"], meta.get("uid", "")
    annotations = (config_map.get("metadata") or {}).get("annotations") or {}
    if uid and annotations.get(retry.RETIRED_ANNOTATION) == uid:
        # Already counted and deleted: the deletion is still in flight.
        await _delete_job(kube, spec, name)
        return Calibrating(name, f"{FIELD}: Job {name} attempt {attempt} is being created")
    failed_at = _failed_at(job)
    decision = retry.decide(rules, attempt, failed_at, now)
    if isinstance(decision, retry.GiveUp):
        raise SpecError(
            f"{FIELD}: the profiling Job {name} failed ({failed}) on attempt {attempt} of "
            f"{rules.attempts}: no attempt is left; delete it to try again",
            FIELD,
        )
    done = f"{FIELD}: the profiling Job {name} failed ({failed}) on attempt {attempt}"
    if isinstance(decision, retry.Wait):
        when = restarts.format_time(decision.at)
        return Calibrating(
            name, f"{done} of {rules.attempts}; attempt {decision.attempt} starts at {when}"
        )
    # Count first: if the pass stops between the two calls the next one finds the Job retired.
    counted = {
        **annotations,
        retry.ATTEMPT_ANNOTATION: str(decision.attempt),
        retry.RETIRED_ANNOTATION: uid,
    }
    ops = [{"op": "add", "path": "/metadata/annotations", "value": counted}]
    await kube.json_patch("v1", "ConfigMap", spec.namespace, name, ops)
    await _delete_job(kube, spec, name)
    await kube.create(fresh)  # False: the old one is still being deleted (the next pass)
    return Calibrating(
        name, f"{done} of {rules.attempts}; attempt {decision.attempt} of {rules.attempts} started"
    )


async def _delete_job(kube: Kube, spec: DeploymentSpec, name: str) -> None:
    await kube.delete("batch/v1", "Job", spec.namespace, name, propagation="Background")


def _failed_at(job: dict[str, Any]) -> dt.datetime | None:
    """When the Job failed (its Failed condition's transition), else when it was created."""
    for c in (job.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Failed" and c.get("lastTransitionTime"):
            return restarts.parse_time(c["lastTransitionTime"])
    return restarts.parse_time((job.get("metadata") or {}).get("creationTimestamp"))


# A calibration's objects in the order they are let go: the Job first (it holds a node's GPUs),
# the ConfigMap last (it names the calibration to the next pass if this one stops midway).
_KINDS = (
    ("batch/v1", "Job"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    ("rbac.authorization.k8s.io/v1", "Role"),
    ("v1", "ServiceAccount"),
    ("v1", "ConfigMap"),
)
Owner = tuple[str, str, str]  # a deployment: namespace, name, uid
_LABELS = {names.LABEL_MANAGED_BY: names.MANAGED_BY, names.LABEL_COMPONENT: "calibration"}


async def retire(kube: Kube, who: Owner, keep: str | None) -> list[str]:
    """Let go of every calibration deployment ``who`` (namespace, name, uid) owns but no longer
    uses (any but key ``keep``; None: all): its owner reference is removed from the
    calibration's objects, and a calibration no deployment references any more is deleted,
    running Job (propagation Background: its pod goes too) and hand-off alike. A calibration
    another deployment references keeps running for it. One line per calibration let go;
    KubeError when a call fails (the next pass tries again)."""
    namespace, _, uid = who
    kept = calibration.name_of(keep) if keep is not None else None
    found = await _calibrations(kube, namespace)
    lines = []
    for name in sorted(found):
        if name != kept and any(_refs(o, uid) for o in found[name]):
            lines.append(await _let_go(kube, who, name))
    return lines


async def _calibrations(kube: Kube, namespace: str) -> dict[str, list[dict[str, Any]]]:
    """The calibrations of ``namespace`` by name, each with its listed Job and ConfigMap. The
    ConfigMap is created first and outlives each failed Job, so it names every calibration
    even where the operator may not list Jobs (a chart from before it could)."""
    listed = await kube.select("v1", "ConfigMap", namespace, _LABELS)
    try:
        listed += await kube.select("batch/v1", "Job", namespace, _LABELS)
    except KubeError as exc:
        if exc.status != 403:
            raise
    found: dict[str, list[dict[str, Any]]] = {}
    for obj in listed:
        meta = obj.get("metadata") or {}
        key = (meta.get("labels") or {}).get(calibration.LABEL_CALIBRATION)
        if key and meta.get("name") == calibration.name_of(key):  # its own objects only
            found.setdefault(meta["name"], []).append(obj)
    return found


def _refs(obj: dict[str, Any], uid: str | None = None) -> list[dict[str, Any]]:
    """``obj``'s owner references (``uid``'s only, when given)."""
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return [r for r in refs if uid is None or r.get("uid") == uid]


async def _read(kube: Kube, namespace: str, name: str) -> dict[str, dict[str, Any]]:
    objects = {}
    for api_version, kind in _KINDS:
        obj = await kube.get(api_version, kind, namespace, name)
        if obj is not None:
            objects[kind] = obj
    return objects


async def _let_go(kube: Kube, who: Owner, name: str) -> str:
    namespace, user, uid = who
    objects = await _read(kube, namespace, name)
    if any(len(_refs(o)) > len(_refs(o, uid)) for o in objects.values()):
        # Another deployment uses it: only this one's reference goes.
        for api_version, kind in _KINDS:
            obj = objects.get(kind)
            refs = _refs(obj) if obj is not None else []
            at = next((i for i, r in enumerate(refs) if r.get("uid") == uid), None)
            if at is None:
                continue
            ops = [
                {"op": "test", "path": f"/metadata/ownerReferences/{at}/uid", "value": uid},
                {"op": "remove", "path": f"/metadata/ownerReferences/{at}"},
            ]
            await kube.json_patch(api_version, kind, namespace, name, ops)
        # Read again after the patches: a deployment that let go meanwhile saw this one's
        # reference, and this one may have removed the last (whoever reads last deletes).
        objects = await _read(kube, namespace, name)
        users = sorted({r.get("name", "") for o in objects.values() for r in _refs(o)})
        if users:
            return f"calibration {name}: no longer used by {user}; kept for {users}"
    for api_version, kind in _KINDS:
        obj = objects.get(kind)
        if obj is None:
            continue
        # Only the version read: one another deployment adopted since is left to it (409).
        version = (obj.get("metadata") or {}).get("resourceVersion") or ""
        propagation = "Background" if kind == "Job" else None
        await kube.delete(api_version, kind, namespace, name, propagation, version)
    running = "Job" in objects and not (_done(objects["Job"]) or _failed(objects["Job"]))
    what = "its running Job and " if running else ""
    return f"calibration {name}: used by no deployment since {user}; deleted {what}its objects"
