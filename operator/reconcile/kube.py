"""A small async client for the children's kinds, over the official `kubernetes` ApiClient.

Objects stay plain dicts in their API (camelCase) form, exactly as the renderers build them.
`apply` is create-or-merge-patch with a last-applied annotation, kubectl-style: fields the
operator stopped setting are removed, fields others set are left alone. (Server-side apply would
do this natively; the JSON merge patch also works against kmock, which has no SSA or PUT.)
"""

from __future__ import annotations

import asyncio
import json
import secrets
from dataclasses import dataclass
from typing import Any

from kubernetes import client

from gearshift.operator.reconcile import names

# (apiVersion, kind) → plural; the only kinds the operator reads or writes besides its own.
PLURALS: dict[tuple[str, str], str] = {
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Service"): "services",
    ("v1", "Pod"): "pods",
    ("v1", "Secret"): "secrets",
    ("v1", "Node"): "nodes",  # cluster-scoped: read for policy: auto's GPU (reconcile/auto.py)
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("apps/v1", "StatefulSet"): "statefulsets",
    ("apps/v1", "Deployment"): "deployments",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudgets",
    ("scheduling.volcano.sh/v1beta1", "PodGroup"): "podgroups",
    ("scheduling.x-k8s.io/v1alpha1", "PodGroup"): "podgroups",
    # spec.policy.auto.calibrate's Job and its hand-off (reconcile/calibration.py).
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("batch/v1", "Job"): "jobs",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
}


class KubeError(RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


def _path(api_version: str, kind: str, namespace: str, name: str = "") -> str:
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{namespace}/{PLURALS[(api_version, kind)]}"
    return f"{path}/{name}" if name else path


def merge_patch(last: dict[str, Any], desired: dict[str, Any]) -> dict[str, Any]:
    """RFC 7386 patch that sets `desired` and removes what `last` had and `desired` lacks."""
    patch: dict[str, Any] = {}
    for key, value in desired.items():
        old = last.get(key)
        if isinstance(value, dict) and isinstance(old, dict):
            patch[key] = merge_patch(old, value)
        else:
            patch[key] = value
    for key in last:
        if key not in desired:
            patch[key] = None
    return patch


def _strip_applied(obj: dict[str, Any]) -> dict[str, Any]:
    out = json.loads(json.dumps(obj))
    annotations = out.get("metadata", {}).get("annotations") or {}
    annotations.pop(names.ANNOTATION_APPLIED, None)
    if "annotations" in out.get("metadata", {}) and not annotations:
        del out["metadata"]["annotations"]
    return out


@dataclass
class Snapshot:
    """One pass's listing of a deployment's children, keyed by (apiVersion, kind, name)."""

    kinds: set[tuple[str, str]]
    objects: dict[tuple[str, str, str], dict[str, Any]]

    def of_kind(self, api_version: str, kind: str) -> list[dict[str, Any]]:
        return [o for (v, k, _), o in self.objects.items() if (v, k) == (api_version, kind)]


@dataclass
class Kube:
    """Blocking client calls run in worker threads so kopf's event loop keeps going."""

    api: client.ApiClient
    timeout_seconds: float = 10.0

    def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: dict[str, str] | None = None,
        patch_type: str = "application/merge-patch+json",
    ) -> Any:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = patch_type if method == "PATCH" else "application/json"
        m, url, h, b, _ = self.api.param_serialize(
            method=method,
            resource_path=path,
            query_params=list((query or {}).items()),
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self.api.call_api(
            m, url, header_params=h, body=b, _request_timeout=self.timeout_seconds
        )
        response.read()
        data: dict[str, Any] = json.loads(response.data) if response.data else {}
        if response.status >= 400:
            raise KubeError(response.status, str(data.get("message", data))[:500])
        return data

    async def _acall(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: dict[str, str] | None = None,
        patch_type: str = "application/merge-patch+json",
    ) -> Any:
        return await asyncio.to_thread(self._call, method, path, body, query, patch_type)

    async def get(
        self, api_version: str, kind: str, namespace: str, name: str
    ) -> dict[str, Any] | None:
        try:
            return dict(await self._acall("GET", _path(api_version, kind, namespace, name)))
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def nodes(self) -> list[dict[str, Any]]:
        """Every Node (cluster-scoped; the caller filters, kmock ignores selectors)."""
        data = await self._acall("GET", "/api/v1/nodes")
        return list(data.get("items") or [])

    async def select(
        self, api_version: str, kind: str, namespace: str, labels: dict[str, str]
    ) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        data = await self._acall(
            "GET", _path(api_version, kind, namespace), query={"labelSelector": selector}
        )
        items = data.get("items") or []
        # Filter again: the server may ignore the selector (kmock does).
        return [
            obj
            for obj in items
            if obj.get("metadata", {}).get("namespace", namespace) == namespace
            and all(
                (obj.get("metadata", {}).get("labels") or {}).get(k) == v for k, v in labels.items()
            )
        ]

    async def snapshot(
        self, kinds: list[tuple[str, str]], namespace: str, labels: dict[str, str]
    ) -> Snapshot:
        # Listed concurrently: a pass's time is mostly these round trips.
        listings = await asyncio.gather(
            *(self.select(api_version, kind, namespace, labels) for api_version, kind in kinds)
        )
        objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        for (api_version, kind), items in zip(kinds, listings, strict=True):
            for obj in items:
                objects[(api_version, kind, obj["metadata"]["name"])] = obj
        return Snapshot(set(kinds), objects)

    async def event(
        self, involved: dict[str, Any], type_: str, reason: str, message: str, now: str
    ) -> None:
        """Post a core/v1 Event about ``involved`` under a name of our own (kmock, unlike an API
        server, gives every generateName the same name)."""
        meta = involved.get("metadata") or {}
        namespace = meta.get("namespace", "default")
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "name": f"{meta.get('name')}.{secrets.token_hex(8)}",
                "namespace": namespace,
            },
            "involvedObject": {
                "apiVersion": involved.get("apiVersion", ""),
                "kind": involved.get("kind", ""),
                "name": meta.get("name", ""),
                "namespace": namespace,
                "uid": meta.get("uid", ""),
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
            "source": {"component": "gearshift-operator"},
        }
        await self._acall("POST", f"/api/v1/namespaces/{namespace}/events", body)

    async def delete(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        propagation: str | None = None,
        resource_version: str = "",
    ) -> bool:
        """Delete; False when it was already gone. ``propagation``: DeleteOptions'
        propagationPolicy (a Job's API default orphans its pods; Background deletes them).
        ``resource_version``: delete only that version (KubeError 409 if it changed since)."""
        body: dict[str, Any] | None = None
        if propagation is not None or resource_version:
            body = {"kind": "DeleteOptions", "apiVersion": "v1"}
            if propagation is not None:
                body["propagationPolicy"] = propagation
            if resource_version:
                body["preconditions"] = {"resourceVersion": resource_version}
        try:
            await self._acall("DELETE", _path(api_version, kind, namespace, name), body)
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    async def create(self, manifest: dict[str, Any]) -> bool:
        """Create the object as given (no annotation added); False when it exists already."""
        meta = manifest["metadata"]
        path = _path(manifest["apiVersion"], manifest["kind"], meta["namespace"])
        try:
            await self._acall("POST", path, manifest)
        except KubeError as exc:
            if exc.status == 409:
                return False
            raise
        return True

    async def json_patch(
        self, api_version: str, kind: str, namespace: str, name: str, ops: list[dict[str, Any]]
    ) -> None:
        """An RFC 6902 patch: applied whole or not at all (its `test` ops guard the rest)."""
        path = _path(api_version, kind, namespace, name)
        await self._acall("PATCH", path, ops, patch_type="application/json-patch+json")

    async def apply(self, manifest: dict[str, Any], snapshot: Snapshot | None = None) -> str:
        """Create or converge one object; returns "created", "updated" or "unchanged".

        With a `snapshot` of this pass's listings the current object is taken from it instead of
        being fetched (one list per kind per pass instead of one GET per child). Never a Secret:
        the last-applied annotation would hold a copy of its data (tokens.py writes Secrets).
        """
        api_version, kind = manifest["apiVersion"], manifest["kind"]
        if kind == "Secret":
            raise ValueError(
                "Kube.apply never writes a Secret: its data would land in an annotation"
            )
        meta = manifest["metadata"]
        desired = _strip_applied(manifest)
        applied_text = json.dumps(desired, sort_keys=True, separators=(",", ":"))
        body = json.loads(applied_text)
        body["metadata"].setdefault("annotations", {})[names.ANNOTATION_APPLIED] = applied_text
        if snapshot is not None and (api_version, kind) in snapshot.kinds:
            current = snapshot.objects.get((api_version, kind, meta["name"]))
        else:
            current = await self.get(api_version, kind, meta["namespace"], meta["name"])
        if current is None:
            await self._acall("POST", _path(api_version, kind, meta["namespace"]), body)
            return "created"
        last_text = (current.get("metadata", {}).get("annotations") or {}).get(
            names.ANNOTATION_APPLIED
        )
        if last_text == applied_text:
            return "unchanged"
        last = json.loads(last_text) if last_text else {}
        patch = merge_patch(last, body)
        await self._acall("PATCH", _path(api_version, kind, meta["namespace"], meta["name"]), patch)
        return "updated"
