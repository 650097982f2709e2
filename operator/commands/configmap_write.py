"""`gearshift profile --layouts ... --configmap NAME`: hand the profile to the operator by
writing it into a ConfigMap the operator created for it (its calibration Job, issue 30 item 1).
The pod's own service account does it, over the API server's HTTPS with the token and CA that
Kubernetes mounts; its Role allows only get and patch on that one ConfigMap
(operator/reconcile/calibration.py). The standard library only: the worker image does not carry
the Kubernetes client."""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
PROFILE_KEY = "profile.json"  # the key the operator reads (sim/auto_policy.PROFILE_KEY)
TIMEOUT_S = 30


class WriteError(RuntimeError):
    """The ConfigMap could not be written; the message says which and why."""


@dataclass(frozen=True)
class ApiServer:
    """Where and as whom to call the API: ``url`` (https://host:port), a bearer token, the CA
    file (None: the system's, or plain http in tests) and the pod's namespace."""

    url: str
    token: str
    namespace: str
    ca_file: Path | None = None

    @classmethod
    def in_cluster(cls, folder: Path = SERVICE_ACCOUNT_DIR) -> ApiServer:
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise WriteError("--configmap: not in a pod (KUBERNETES_SERVICE_HOST is not set)")
        try:
            token = (folder / "token").read_text().strip()
            namespace = (folder / "namespace").read_text().strip()
        except OSError as exc:
            raise WriteError(f"--configmap: no service-account token mounted ({exc})") from None
        if ":" in host:  # an IPv6 address
            host = f"[{host}]"
        return cls(f"https://{host}:{port}", token, namespace, folder / "ca.crt")


def write_profile(api: ApiServer, name: str, text: str) -> None:
    """Patch ``text`` into ConfigMap ``name``'s ``profile.json`` (a merge patch: the ConfigMap
    must exist, the operator made it; a patch is all the Role allows)."""
    body = json.dumps({"data": {PROFILE_KEY: text}}).encode()
    request = urllib.request.Request(
        f"{api.url}/api/v1/namespaces/{api.namespace}/configmaps/{name}",
        data=body,
        method="PATCH",
        headers={
            "Authorization": f"Bearer {api.token}",
            "Content-Type": "application/merge-patch+json",
            "Accept": "application/json",
        },
    )
    context = None
    if api.url.startswith("https://"):
        context = ssl.create_default_context(cafile=str(api.ca_file) if api.ca_file else None)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S, context=context) as response:
            response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:300]
        raise WriteError(
            f"--configmap {name}: the API server answered {exc.code}: {detail}"
        ) from None
    except (urllib.error.URLError, OSError) as exc:
        raise WriteError(f"--configmap {name}: cannot reach the API server: {exc}") from None
