"""A failed ``auto.calibrate`` Job is tried again (issue 30, item 4): kopf against kmock with two
attempts and a 1 s backoff. The test plays the Job controller: it marks the Job failed; the
operator deletes it and creates it again after the backoff, the conditions saying the attempt; the
last attempt's failure is refused naming the field; a new calibration key starts over (and the
old key's calibration, used by no one, is deleted)."""

from __future__ import annotations

import copy
import datetime as dt
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cpu_profile import MODEL
from kmock_harness import (
    Api,
    KmockApi,
    OperatorProcess,
    StandInAdmin,
    condition,
    cr_metadata,
    running_operator,
    wait_for,
)

from gearshift.operator.reconcile import calibration_retry, names
from gearshift.operator.reconcile.restarts import format_time

NS = "auto-calibrate-retry"
STS = f"/apis/apps/v1/namespaces/{NS}/statefulsets"
JOBS = f"/apis/batch/v1/namespaces/{NS}/jobs"
CMS = f"/api/v1/namespaces/{NS}/configmaps"
REPO = Path(__file__).resolve().parents[2]
FIELD = "spec.policy.auto.calibrate"
CALIBRATION = {names.LABEL_COMPONENT: "calibration"}


@pytest.fixture(scope="module")
def operator_process(
    kmock_api: KmockApi, admin: StandInAdmin, hub: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    tmp = tmp_path_factory.mktemp("operator-calibrate-retry")
    env = {
        "HF_ENDPOINT": hub.url,
        "GEARSHIFT_CALIBRATION_ATTEMPTS": "2",
        "GEARSHIFT_CALIBRATION_BACKOFF_SECONDS": "1",
        "GEARSHIFT_CALIBRATION_BACKOFF_MAX_SECONDS": "1",
    }
    with running_operator(kmock_api, admin, tmp, env) as op:
        yield op


@pytest.fixture(scope="module")
def h100_node(api: Api) -> Iterator[None]:
    labels = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    node = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": "retry-node", "labels": labels},
    }
    code, data = api.call("POST", "/api/v1/nodes", node)
    assert code in (200, 201), data
    yield
    api.call("DELETE", "/api/v1/nodes/retry-node")


def _body(name: str, image: str) -> dict[str, Any]:
    body = yaml.safe_load((REPO / "docs/examples/auto.yaml").read_text())
    body["metadata"] = cr_metadata(name, NS)
    body["spec"]["group"] = {"nodes": 1, "gpusPerNode": 2}
    body["spec"]["images"]["worker"] = image
    a = body["spec"]["policy"]["auto"]
    a.pop("goodput")
    traffic = {"rate": 2, "prompt": {"fixed": 64}, "output": {"fixed": 16}}
    a.update(model=dict(MODEL), requests=20, traffic=copy.deepcopy(traffic), calibrate=True)
    return body


def _job(api: Api) -> dict[str, Any] | None:
    jobs = api.items(JOBS, CALIBRATION)
    return jobs[0] if len(jobs) == 1 else None


def _fail(api: Api, job: dict[str, Any]) -> None:
    """What the Job controller writes when its pod fails."""
    now = format_time(dt.datetime.now(dt.UTC))
    cond = {
        "type": "Failed",
        "status": "True",
        "reason": "BackoffLimitExceeded",
        "message": "Job has reached the specified backoff limit",
        "lastTransitionTime": now,
    }
    path = f"{JOBS}/{job['metadata']['name']}"
    code, data = api.call("PATCH", path, {"status": {"conditions": [cond], "failed": 1}})
    assert code == 200, data


def _fresh(api: Api) -> dict[str, Any] | None:
    """The Job, when no Job controller has written its status yet."""
    job = _job(api)
    return job if job is not None and not (job.get("status") or {}).get("conditions") else None


def test_a_failed_job_is_recreated_after_the_backoff_and_given_up_after_the_last_attempt(
    api: Api, operator_process: OperatorProcess, h100_node: None
) -> None:
    name = "retry"
    try:
        api.create_cr(NS, _body(name, "ghcr.io/gearshift/worker:0.1.0"))
        first = wait_for(lambda: _job(api), 30, what="the profiling Job")
        job_name = first["metadata"]["name"]
        wait_for(
            lambda: "attempt 1 of 2" in condition(api.cr(NS, name), "Ready").get("message", ""), 30
        )

        _fail(api, first)
        second = wait_for(lambda: _fresh(api), 30, what="the Job created again")
        assert second["metadata"]["name"] == job_name
        cm = api.get(f"{CMS}/{job_name}") or {}
        annotations = cm["metadata"].get("annotations") or {}
        assert annotations[calibration_retry.ATTEMPT_ANNOTATION] == "2"
        wait_for(
            lambda: "attempt 2 of 2" in condition(api.cr(NS, name), "Ready").get("message", ""), 30
        )
        ready = condition(api.cr(NS, name), "Ready")
        assert ready["reason"] == "Calibrating" and ready["status"] == "False", ready
        assert not api.names(STS, {names.LABEL_DEPLOYMENT: name})

        _fail(api, second)
        wait_for(lambda: condition(api.cr(NS, name), "InvalidSpec").get("status") == "True", 30)
        invalid = condition(api.cr(NS, name), "InvalidSpec")
        assert invalid["reason"] == "SpecPolicyAutoCalibrate", invalid
        assert invalid["message"].startswith(f"{FIELD}: the profiling Job {job_name} failed")
        assert "attempt 2 of 2: no attempt is left" in invalid["message"], invalid
        job = _job(api)  # not created a third time: the failed one stays
        assert job is not None and (job.get("status") or {}).get("conditions"), job

        # Another calibration key (here the worker image) is another Job: attempt 1 again.
        api.patch_spec(NS, name, {"images": {"worker": "ghcr.io/gearshift/worker:0.1.1"}})
        wait_for(
            lambda: "attempt 1 of 2" in condition(api.cr(NS, name), "Ready").get("message", ""),
            30,
            what="the new key's first attempt",
        )
        (new,) = [j for j in api.items(JOBS, CALIBRATION) if j["metadata"]["name"] != job_name]
        assert new["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":0.1.1")
        # The given-up calibration is no one's any more: deleted (calibration_run.retire).
        wait_for(lambda: api.get(f"{JOBS}/{job_name}") is None, 30, what="the old Job deleted")
        wait_for(lambda: api.get(f"{CMS}/{job_name}") is None, 30, what="its ConfigMap deleted")
    finally:
        api.delete_all_crs(NS)
