"""Test harness: kmock as a real HTTP Kubernetes API, the operator as a real kopf process, and a
stand-in for the router's Admin API.

kmock 0.8 gaps and how the tests live with them (DESIGN.md): it sets no uid, resourceVersion or
generation, so the tests write uid and generation themselves; it ignores label selectors, so the
operator filters lists itself; it has no garbage collector, so deletion is checked through the
operator's explicit cleanup and the owner references it sets. It also keeps every request it
served, and matches each new one against that whole history (quadratic in a module's requests:
a kopf operator polling for minutes made the emulator the busiest process of the suite), so the
harness keeps only the latest ones (``_RecentRequests``); no test reads kmock's history.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from kmock import KubernetesEmulator, ResourceInfo, Server
from kubernetes import client

from gearshift.operator.reconcile import names
from gearshift.v1 import policy_fields, policy_pb2, router_pb2, router_pb2_grpc, worker_pb2

CR_PATH = f"/apis/{names.GROUP}/{names.VERSION}/namespaces/{{ns}}/{names.PLURAL}"


class _RecentRequests(list[Any]):
    """kmock's request history, cut to the newest ``keep`` entries on every append: kmock only
    needs the request it is serving to be in it (it checks membership by identity)."""

    keep = 64

    def append(self, item: Any) -> None:
        super().append(item)
        if len(self) > 2 * self.keep:
            del self[: -self.keep]


class KmockApi:
    """kmock's Kubernetes emulator served over HTTP on a loopback port, in its own thread."""

    def __init__(self) -> None:
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> KmockApi:
        ready = threading.Event()

        async def serve() -> None:
            self._stop = asyncio.Event()
            async with KubernetesEmulator() as emulator, Server(emulator) as server:
                emulator.resources.load_bundled()
                object.__setattr__(emulator, "_requests", _RecentRequests())
                emulator.resources[f"{names.GROUP}/{names.VERSION}/{names.PLURAL}"] = ResourceInfo(
                    kind=names.KIND,
                    singular="inferencedeployment",
                    namespaced=True,
                    shortnames={"infd"},
                    verbs={"get", "list", "watch", "create", "patch", "delete"},
                    subresources={"status", "scale"},
                )
                self.port = server.port
                self._loop = asyncio.get_running_loop()
                ready.set()
                await self._stop.wait()

        self._thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
        self._thread.start()
        if not ready.wait(15):
            raise RuntimeError("kmock did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(15)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kubeconfig(self, path: Path) -> Path:
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
            "users": [{"name": "test", "user": {"token": "test"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "test"}}],
            "current-context": "kmock",
        }
        path.write_text(json.dumps(cfg))
        return path


class Api:
    """Plain-dict HTTP calls against kmock, as a user with kubectl would make them."""

    def __init__(self, url: str) -> None:
        cfg = client.Configuration()
        cfg.host = url
        self._client = client.ApiClient(cfg)

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = (
                "application/merge-patch+json" if method == "PATCH" else "application/json"
            )
        m, url, h, b, _ = self._client.param_serialize(
            method=method, resource_path=path, header_params=headers, body=body
        )
        response = self._client.call_api(m, url, header_params=h, body=b, _request_timeout=10)
        response.read()
        return response.status, json.loads(response.data) if response.data else None

    def get(self, path: str) -> dict[str, Any] | None:
        code, data = self.call("GET", path)
        return data if code == 200 else None

    def items(self, path: str, labels: dict[str, str] | None = None) -> list[dict[str, Any]]:
        data = self.get(path) or {}
        return [
            o
            for o in data.get("items", [])
            if all(
                (o["metadata"].get("labels") or {}).get(k) == v for k, v in (labels or {}).items()
            )
        ]

    def names(self, path: str, labels: dict[str, str] | None = None) -> set[str]:
        return {o["metadata"]["name"] for o in self.items(path, labels)}

    def create_cr(self, ns: str, body: dict[str, Any]) -> None:
        code, data = self.call("POST", CR_PATH.format(ns=ns), body)
        assert code in (200, 201), data

    def cr(self, ns: str, name: str) -> dict[str, Any] | None:
        return self.get(f"{CR_PATH.format(ns=ns)}/{name}")

    def delete_all_crs(self, ns: str, timeout: float = 60) -> None:
        """Delete every InferenceDeployment in ``ns`` and wait until the operator let them go.

        A module's operator resyncs every resource it knows each pass: resources left over from
        earlier tests only slow the later ones down.
        """
        path = CR_PATH.format(ns=ns)
        for obj in self.items(path):
            self.call("DELETE", f"{path}/{obj['metadata']['name']}")
        wait_for(lambda: not self.items(path), timeout, "test deployments deleted")

    def patch_spec(self, ns: str, name: str, spec_patch: dict[str, Any]) -> None:
        """Patch the spec and bump metadata.generation, as the API server would."""
        current = self.cr(ns, name)
        assert current is not None
        generation = int(current["metadata"].get("generation", 1)) + 1
        body = {"metadata": {"generation": generation}, "spec": spec_patch}
        code, data = self.call("PATCH", f"{CR_PATH.format(ns=ns)}/{name}", body)
        assert code == 200, data


def cr_metadata(name: str, ns: str) -> dict[str, Any]:
    """metadata for a test resource: kmock sets none of uid, generation, resourceVersion, and
    kopf's finalizer JSON-patch tests the resourceVersion (which kmock then never changes)."""
    return {
        "name": name,
        "namespace": ns,
        "uid": f"uid-{name}",
        "generation": 1,
        "resourceVersion": "1",
    }


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return dict(c)
    return {}


def events(api: Api, ns: str, name: str, reason: str) -> list[dict[str, Any]]:
    """The events of reason ``reason`` the operator wrote about the object ``name``."""
    return [
        e
        for e in api.items(f"/api/v1/namespaces/{ns}/events")
        if (e.get("involvedObject") or {}).get("name") == name and e.get("reason") == reason
    ]


def wait_for(predicate: Callable[[], Any], timeout: float = 20.0, what: str = "") -> Any:
    """Poll until `predicate()` is truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(0.1)


def mount_secret_token(api: Api, ns: str, secret: str, path: Path, timeout: float = 60) -> str:
    """What the kubelet does for a pod that mounts a token Secret: wait until the operator
    created it, then put its token into `path` (a new file renamed in, as the kubelet swaps a
    Secret volume's files); returns the token."""
    found = wait_for(lambda: api.get(f"/api/v1/namespaces/{ns}/secrets/{secret}"), timeout, secret)
    token = base64.b64decode(found["data"][names.CONTROL_TOKEN_KEY]).decode()
    tmp = path.with_name(f".{path.name}.new")
    tmp.write_text(token)
    os.replace(tmp, path)
    return token


class StandInAdmin(router_pb2_grpc.AdminServicer):
    """A stand-in for the router's Admin API (the real router comes with the control-plane issue).

    Tests decide which groups it reports serving; ApplyPolicy merges live fields into the
    reported policies the way Worker.ApplyPolicy is specified to.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.groups: dict[str, router_pb2.GroupStatus] = {}
        self.applied: list[policy_pb2.Policy] = []
        self.drained: list[str] = []
        self.authorization: list[str] = []
        # What GetStatus reports as the router's observed traffic, and whether it answers at all.
        self.traffic = router_pb2.ObservedTraffic()
        self.unavailable = False
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        router_pb2_grpc.add_AdminServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    def __enter__(self) -> StandInAdmin:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None).wait(5)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def serve(
        self, group: str, policy: policy_pb2.Policy, revision: str = "", gear: str = "base"
    ) -> None:
        """Report `group` serving `policy`, started at layout `revision`."""
        with self._lock:
            self.groups[group] = router_pb2.GroupStatus(
                name=group,
                address=f"{group}:50051",
                serving=True,
                gear=gear,
                policy=policy,
                stats=worker_pb2.WorkerStats(revision=revision, gear=gear, policy=policy),
            )

    def stop_serving(self, group: str) -> None:
        with self._lock:
            if group in self.groups:
                self.groups[group].serving = False

    def GetStatus(self, request: Any, context: Any) -> router_pb2.RouterStatus:
        with self._lock:
            # The credentials the operator presented (its deployment's admin token; after a
            # rotation, the old one too).
            presented = [v for k, v in context.invocation_metadata() if k == "authorization"]
            self.authorization += presented or [""]
            if self.unavailable:
                context.abort(grpc.StatusCode.UNAVAILABLE, "stand-in router is down")
            return router_pb2.RouterStatus(
                groups=list(self.groups.values()), model="stand-in", traffic=self.traffic
            )

    def ApplyPolicy(self, request: Any, context: Any) -> router_pb2.AdminApplyPolicyResponse:
        with self._lock:
            self.applied.append(request.policy)
            results = []
            for g in self.groups.values():
                if request.group and g.name != request.group:
                    continue
                kind = policy_fields.kind_of(request.policy)
                if kind != policy_fields.kind_of(g.policy):
                    results.append(
                        router_pb2.GroupApplyResult(group=g.name, applied=False, message="kind")
                    )
                    continue
                getattr(g.policy, kind).MergeFrom(getattr(request.policy, kind))
                results.append(
                    router_pb2.GroupApplyResult(group=g.name, applied=True, policy=g.policy)
                )
            return router_pb2.AdminApplyPolicyResponse(
                applied=all(r.applied for r in results), results=results
            )

    def Drain(self, request: Any, context: Any) -> router_pb2.DrainResponse:
        with self._lock:
            self.drained.append(request.group)
            return router_pb2.DrainResponse(in_flight=0)


class OperatorProcess:
    """`python -m gearshift.operator.reconcile --all-namespaces` against kmock, as a subprocess.

    Cluster-wide: kmock 0.8 cannot serve kopf's namespaced watches.
    """

    def __init__(
        self,
        kubeconfig: Path,
        admin_address: str,
        log: Path,
        resync: float = 0.5,
        env: dict[str, str] | None = None,
    ) -> None:
        self._cmd = [
            sys.executable,
            "-m",
            "gearshift.operator.reconcile",
            "--all-namespaces",
            "--verbose",
        ]
        self._env = {
            **os.environ,
            "KUBECONFIG": str(kubeconfig),
            "GEARSHIFT_ROUTER_ADMIN_ADDRESS": admin_address,
            "GEARSHIFT_RESYNC_SECONDS": str(resync),
            "GEARSHIFT_ADMIN_TIMEOUT_SECONDS": "1",
            **(env or {}),
        }
        self.log = log
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> OperatorProcess:
        self._file = self.log.open("wb")
        self._proc = subprocess.Popen(
            self._cmd, env=self._env, stdout=self._file, stderr=subprocess.STDOUT
        )
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._proc is not None
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(5)
        self._file.close()

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None


@contextlib.contextmanager
def running_operator(
    kmock_api: KmockApi, admin: StandInAdmin, tmp: Path, env: dict[str, str] | None = None
) -> Iterator[OperatorProcess]:
    """An operator process against kmock, awaited alive (bounded). Its log's tail is printed at
    the end: pytest shows captured output only for failures, so that is where it appears."""
    with OperatorProcess(
        kmock_api.kubeconfig(tmp / "kubeconfig"), admin.address, tmp / "kopf.log", env=env
    ) as op:
        try:
            wait_for(op.alive, 5, "operator process")
            yield op
        finally:
            print(op.log.read_text()[-4000:])
