"""kopf handlers for InferenceDeployment: thin, idempotent, all roads lead to one reconcile pass.

create/update/resume react to changes; a timer re-runs the same pass every `resync_seconds`, so
router readiness, pod failures and rollout progress are noticed without watching every kind.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from pathlib import Path
from typing import Any

import kopf
from kubernetes import client, config

from gearshift.operator.reconcile import calibration_run, names
from gearshift.operator.reconcile.auto_planner import Planner
from gearshift.operator.reconcile.kube import Kube, KubeError
from gearshift.operator.reconcile.reconciler import Reconciler
from gearshift.operator.reconcile.render_meta import is_owned_by
from gearshift.operator.reconcile.settings import OperatorSettings
from gearshift.operator.reconcile.tokens import TokenKeeper

# Read once at import: kopf needs the timer interval when the decorator runs. Frozen, not shared
# mutable state.
SETTINGS = OperatorSettings.from_env()
RESOURCE = (names.GROUP, names.VERSION, names.PLURAL)

# Children deleted explicitly on deletion (garbage collection does it too, through the owner
# references; kmock and clusters with GC lag do not).
_CHILD_KINDS = (
    ("apps/v1", "StatefulSet"),
    ("apps/v1", "Deployment"),
    ("v1", "Service"),
    ("v1", "ConfigMap"),
    ("policy/v1", "PodDisruptionBudget"),
    ("v1", "Pod"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
)


def _api_client() -> client.ApiClient:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = f"{names.GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=names.GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING
    memo["kube"] = Kube(_api_client())
    # One keeper for every resource (each resource's memo is a shallow copy of this one).
    key_file = Path(SETTINGS.key_file) if SETTINGS.key_file else None
    memo["tokens"] = TokenKeeper(memo["kube"], key_file)
    # One planner for every resource: each deployment's plan runs in a child process of it.
    memo["planner"] = Planner(SETTINGS.plan_timeout_seconds, SETTINGS.plan_retry_seconds)


@kopf.on.cleanup()
def stop_plans(memo: kopf.Memo, **_: Any) -> None:
    memo["planner"].close()


async def _reconcile(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: Any) -> None:
    # The timer and the change handlers may fire together for one object; one pass at a time.
    lock = memo.setdefault("lock", asyncio.Lock())
    async with lock:
        reconciler = Reconciler(
            memo["kube"],
            SETTINGS,
            logger,
            memo["tokens"],
            memo.setdefault("plans", {}),
            planner=memo["planner"],
            calibrations=memo.setdefault("calibrations", {}),
        )
        new_status = await reconciler.reconcile(dict(body), dt.datetime.now(dt.UTC))
    old = dict(body.get("status") or {})
    for key, value in new_status.items():
        patch.status[key] = replacing(old.get(key), value)


def replacing(old: Any, new: Any) -> Any:
    """``new`` as a JSON merge patch over ``old``: a merge patch merges objects key by key, so a
    key ``old`` has and ``new`` lacks is nulled (removed) instead of surviving; None removes."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    out = {k: replacing(old.get(k), v) for k, v in new.items()}
    out.update({k: None for k in old if k not in new})
    return out


@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE)
@kopf.on.resume(*RESOURCE)
async def on_change(
    body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: Any, **_: Any
) -> None:
    await _reconcile(body, patch, memo, logger)


@kopf.timer(*RESOURCE, interval=SETTINGS.resync_seconds, initial_delay=SETTINGS.resync_seconds)
async def resync(
    body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: Any, **_: Any
) -> None:
    if body.get("metadata", {}).get("deletionTimestamp"):
        return
    await _reconcile(body, patch, memo, logger)


@kopf.on.delete(*RESOURCE)
async def on_delete(body: kopf.Body, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    # From the metadata alone: a deployment whose spec turned invalid after it ran still has
    # children, and may have a plan in flight.
    meta = body.get("metadata") or {}
    namespace, name, uid = (str(meta.get(k) or "") for k in ("namespace", "name", "uid"))
    owner = (namespace, name, uid)
    memo.setdefault("plans", {}).pop(owner, None)
    memo["planner"].forget(owner)
    memo.setdefault("calibrations", {}).pop(owner, None)
    kube: Kube = memo["kube"]
    try:
        # Shared, so not children: its own reference goes, and a calibration no other deployment
        # uses is deleted (the garbage collector would too, later; kmock has none).
        for line in await calibration_run.retire(kube, owner, None):
            logger.info("%s", line)
    except KubeError as exc:  # the garbage collector still deletes what only this one owned
        logger.warning("could not let go of the calibrations of %s: %s", name, exc)
    for api_version, kind in _CHILD_KINDS:
        for obj in await kube.select(api_version, kind, namespace, {names.LABEL_DEPLOYMENT: name}):
            if is_owned_by(obj, name, uid) or kind == "Pod":
                await kube.delete(api_version, kind, namespace, obj["metadata"]["name"])
    # The token Secrets go with the owner reference (garbage collection): the operator may not
    # delete Secrets at all, so it can never delete one it did not make.
    memo["tokens"].forget(owner)
    logger.info("deleted the children of %s/%s", namespace, name)
