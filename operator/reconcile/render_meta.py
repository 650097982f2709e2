"""Metadata every child carries: name, namespace, labels and the owner reference.

The owner reference (controller: true) makes Kubernetes garbage-collect every child when the
InferenceDeployment is deleted, and lets the operator adopt children it finds by name.
"""

from __future__ import annotations

from typing import Any

from gearshift.operator.reconcile import names
from gearshift.operator.reconcile.spec import DeploymentSpec


def owner_reference(spec: DeploymentSpec) -> dict[str, Any]:
    return {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "name": spec.name,
        "uid": spec.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def child_metadata(
    spec: DeploymentSpec,
    name: str,
    component: str,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": spec.namespace,
        "labels": {**names.base_labels(spec.name, component), **(labels or {})},
        "ownerReferences": [owner_reference(spec)],
    }
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


def is_owned_by(obj: dict[str, Any], name: str, uid: str) -> bool:
    """Whether `obj` is the child of deployment ``name`` of ``uid`` (by owner uid, or by labels
    when uid is unknown)."""
    meta = obj.get("metadata", {})
    refs = meta.get("ownerReferences") or []
    if uid and any(r.get("uid") == uid for r in refs):
        return True
    return (meta.get("labels") or {}).get(names.LABEL_DEPLOYMENT) == name and not refs
