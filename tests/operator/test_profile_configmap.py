"""``gearshift profile --layouts ... --configmap NAME`` (issue 30, item 1): the calibration Job's
hand-off, a merge patch of the profile into the ConfigMap the operator made, tested against a real
API server process (kmock); and the option's refusals, before any profiling starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from kmock_harness import Api, KmockApi

from gearshift.operator.commands.configmap_write import ApiServer, WriteError, write_profile

NS = "profile-write"
CMS = f"/api/v1/namespaces/{NS}/configmaps"
GEARSHIFT = [sys.executable, "-m", "gearshift.operator.cli"]


def test_the_profile_is_patched_into_the_existing_config_map(
    kmock_api: KmockApi, api: Api, cpu_profile: str
) -> None:
    name = "gearshift-calibration-0123456789ab"
    meta = {"name": name, "namespace": NS, "labels": {"gearshift.dev/calibration": "0123"}}
    code, data = api.call("POST", CMS, {"metadata": meta, "data": {}})
    assert code in (200, 201), data
    write_profile(ApiServer(kmock_api.url, "a-token", NS), name, cpu_profile)
    written = api.get(f"{CMS}/{name}")
    assert written is not None and written["data"] == {"profile.json": cpu_profile}
    assert written["metadata"]["labels"] == meta["labels"]  # a merge patch: the rest is kept


def test_a_missing_config_map_is_an_error_naming_it(kmock_api: KmockApi) -> None:
    with pytest.raises(WriteError, match="--configmap no-such: the API server answered 404"):
        write_profile(ApiServer(kmock_api.url, "a-token", NS), "no-such", "{}")


def test_in_cluster_reads_the_mounted_service_account(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(WriteError, match="not in a pod"):
        ApiServer.in_cluster(tmp_path)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    with pytest.raises(WriteError, match="no service-account token mounted"):
        ApiServer.in_cluster(tmp_path)
    (tmp_path / "token").write_text("tok\n")
    (tmp_path / "namespace").write_text("ml")
    api = ApiServer.in_cluster(tmp_path)
    assert api == ApiServer("https://10.0.0.1:6443", "tok", "ml", tmp_path / "ca.crt")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--configmap", "x"], "--configmap: only with --layouts"),
        (["--layouts", "one", "--configmap", "x"], "not in a pod"),
        (["--layouts", "one", "--configmap", "Bad/Name"], "is not a ConfigMap name"),
    ],
)
def test_the_option_is_refused_before_profiling(tmp_path: Path, args: list[str], says: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
    out = subprocess.run(
        [*GEARSHIFT, "profile", "--model", str(tmp_path / "none"), "-o", str(tmp_path / "p.json"),
         *args],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 2 and says in out.stderr, out.stderr
    assert not (tmp_path / "p.json").exists()
