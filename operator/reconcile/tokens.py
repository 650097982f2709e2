"""A deployment's two tokens: derived from the operator's key, written into Secrets the operator
creates, and never read back.

The operator needs the admin token to call the router's Admin API, yet it should read no Secret
it does not need, and Kubernetes RBAC cannot grant `get` on some Secrets of a namespace and not
others. So it never reads them: each token is HMAC-SHA256(operator key, purpose, namespace,
name, uid, epoch), computed again after a restart, and written (a create, or else a JSON patch
whose `test` operations require the Secret to carry this deployment's labels, so a Secret someone
else made under the same name is refused, never overwritten). Only pods mount these Secrets. The
key is a file the chart mounts into the operator's pod from a Secret in its own namespace: the
operator reads no Secret through the API at all. Nothing is written into an annotation:
`Kube.apply` would copy the data there.

Rotation: a new value of the `gearshift.dev/token-epoch` annotation derives new tokens; the
Secrets are rewritten, pods re-read their mounted files (auth.TokenSource), and the operator
presents the old admin token too for auth.DEFAULT_GRACE_S, until every router has the new one.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gearshift.operator.reconcile import names
from gearshift.operator.reconcile.kube import Kube, KubeError
from gearshift.operator.reconcile.render_meta import child_metadata, owner_reference
from gearshift.operator.reconcile.spec import DeploymentSpec, SpecError
from gearshift.worker.server import auth

log = logging.getLogger(__name__)

ADMIN, CONTROL = "admin", "control"
_SECRET_NAMES = {ADMIN: names.admin_secret, CONTROL: names.control_secret}
KEY_BYTES = 32


def derive(key: bytes, purpose: str, spec: DeploymentSpec, epoch: str) -> str:
    """The `purpose` token of this deployment (this uid) at `epoch`: 256 bits, URL-safe."""
    message = "\0".join(("gearshift-token", purpose, spec.namespace, spec.name, spec.uid, epoch))
    digest = hmac.new(key, message.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def token_secret(spec: DeploymentSpec, purpose: str, token: str) -> dict[str, Any]:
    """The Secret holding one of the deployment's tokens; garbage-collected with its owner."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": child_metadata(spec, _SECRET_NAMES[purpose](spec.name), f"{purpose}-token"),
        "type": "Opaque",
        "data": {names.CONTROL_TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def _pointer(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def guarded_update(spec: DeploymentSpec, secret: dict[str, Any]) -> list[dict[str, Any]]:
    """A JSON patch that rewrites an existing Secret only if it carries this deployment's labels
    (the API server applies all of it or nothing); it also drops every annotation, which on
    Secrets of older operators held a copy of the token."""
    labels = f"/metadata/labels/{_pointer(names.LABEL_MANAGED_BY)}"
    deployment = f"/metadata/labels/{_pointer(names.LABEL_DEPLOYMENT)}"
    return [
        {"op": "test", "path": labels, "value": names.MANAGED_BY},
        {"op": "test", "path": deployment, "value": spec.name},
        {"op": "add", "path": "/metadata/annotations", "value": {}},
        {"op": "add", "path": "/metadata/ownerReferences", "value": [owner_reference(spec)]},
        {"op": "add", "path": "/data", "value": secret["data"]},
    ]


@dataclass
class TokenKeeper:
    """Writes each deployment's tokens once per operator process (and per epoch), and hands the
    reconciler the admin token to present."""

    kube: Kube
    # The file (a Secret the chart mounts into the operator's pod) holding the key every token
    # derives from; None: a key of this process only (tests, development).
    key_file: Path | None = None
    key: bytes | None = None
    # (namespace, name, uid, purpose) → the epoch whose token is in the Secret.
    written: dict[tuple[str, str, str, str], str] = field(default_factory=dict)
    # (namespace, name, uid) → the admin token an epoch change replaced, and until when.
    previous: dict[tuple[str, str, str], tuple[str, float]] = field(default_factory=dict)

    def operator_key(self) -> bytes:
        """The key every token derives from, read once from its file."""
        if self.key is not None:
            return self.key
        if self.key_file is None:
            log.warning(
                "no operator key (GEARSHIFT_OPERATOR_KEY_FILE): tokens derive from a key of this "
                "process; after a restart they change, and pods pick the new ones up"
            )
            self.key = secrets.token_bytes(KEY_BYTES)
            return self.key
        try:
            key = self.key_file.read_bytes().strip()
        except OSError as exc:
            raise OSError(f"cannot read the operator key {self.key_file}: {exc}") from exc
        if len(key) < KEY_BYTES:
            raise ValueError(f"the operator key {self.key_file} is shorter than {KEY_BYTES} bytes")
        self.key = key
        return key

    async def admin_token(self, spec: DeploymentSpec) -> auth.TokenSource:
        """Make sure both Secrets hold this epoch's tokens; the admin token to present (with
        the one it replaced, for the grace window)."""
        key = self.operator_key()
        epoch = spec.token_epoch
        ident = (spec.namespace, spec.name, spec.uid)
        for purpose in (CONTROL, ADMIN):
            if self.written.get((*ident, purpose)) == epoch:
                continue
            token = derive(key, purpose, spec, epoch)
            await self._write(spec, token_secret(spec, purpose, token))
            old = self.written.get((*ident, purpose))
            if purpose == ADMIN and old is not None:
                until = time.monotonic() + auth.DEFAULT_GRACE_S
                self.previous[ident] = (derive(key, ADMIN, spec, old), until)
            self.written[(*ident, purpose)] = epoch
        current = derive(key, ADMIN, spec, epoch)
        previous, until = self.previous.get(ident, ("", 0.0))
        return auth.TokenSource(current, previous=previous, previous_until=until)

    async def _write(self, spec: DeploymentSpec, secret: dict[str, Any]) -> None:
        meta = secret["metadata"]
        if await self.kube.create(secret):
            log.info("created Secret %s/%s", meta["namespace"], meta["name"])
            return
        try:
            await self.kube.json_patch(
                "v1", "Secret", meta["namespace"], meta["name"], guarded_update(spec, secret)
            )
        except KubeError as exc:
            if exc.status == 404:  # deleted meanwhile: the next pass creates it
                raise
            raise SpecError(
                f"metadata.name: the Secret {meta['name']} exists and is not this deployment's "
                f"(labels {names.LABEL_MANAGED_BY}={names.MANAGED_BY}, "
                f"{names.LABEL_DEPLOYMENT}={spec.name}); the operator does not overwrite it: "
                f"delete it or rename the deployment ({exc})",
                "metadata.name",
            ) from exc

    def forget(self, ident: tuple[str, str, str]) -> None:
        """Drop what is remembered of a deleted deployment (namespace, name, uid)."""
        self.previous.pop(ident, None)
        for purpose in (ADMIN, CONTROL):
            self.written.pop((*ident, purpose), None)
