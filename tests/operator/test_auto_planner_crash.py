"""A `policy: auto` planner child that dies without answering (the OOM killer's SIGKILL): the
inputs are planned again after the same back-off as a timeout, the deployment says why meanwhile,
and no child process is left behind. A refusal the child answers (a field at fault) stays."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime as dt
import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from google.protobuf import json_format
from kmock_harness import KmockApi, condition, cr_metadata
from kubernetes import client

from gearshift.operator.reconcile import auto_planner
from gearshift.operator.reconcile.kube import Kube
from gearshift.operator.reconcile.reconciler import Reconciler
from gearshift.operator.reconcile.settings import OperatorSettings
from gearshift.operator.reconcile.tokens import TokenKeeper
from gearshift.v1 import policy_pb2

REPO = Path(__file__).resolve().parents[2]
NS = "planner-crash"
OWNER = ("ns", "x", "u")
NOW = dt.datetime(2026, 11, 24, tzinfo=dt.UTC)
# Every policy the simulator runs at 5000 requests per rate point: minutes of simulation, so the
# child is still planning when it is killed.
SLOW: dict[str, Any] = {"requests": 5000, "policies": []}


def _auto(**fields: Any) -> dict[str, Any]:
    body = yaml.safe_load((REPO / "docs/examples/auto.yaml").read_text())
    a = copy.deepcopy(body["spec"]["policy"]["auto"])
    a.pop("goodput")
    a.update(gpu="H100", **fields)
    return dict(a)


def _request(gpu: str = "H100", **fields: Any) -> auto_planner.PlanRequest:
    msg = policy_pb2.AutoPolicy()
    json_format.ParseDict(_auto(**fields), msg)
    return auto_planner.PlanRequest(msg.SerializeToString(), gpu, 8, 8, 1, 32768)


def _children() -> set[int]:
    """This process's planner children (not multiprocessing's resource tracker)."""
    found = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if "spawn_main" in " ".join(p.cmdline()):
                found.add(p.pid)
        except psutil.NoSuchProcess:  # exited meanwhile
            pass
    return found


def _gone(pids: set[int], timeout: float = 10) -> bool:
    """Every process of ``pids`` has exited and been reaped (no zombie left)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(pid) for pid in pids):
            return True
        time.sleep(0.05)
    return False


def _until(poll: Any, done: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = poll()
        if done(value):
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _kill_the_child(before: set[int]) -> int:
    """SIGKILL the one planner child started since ``before``, as the OOM killer does."""
    new = _until(lambda: _children() - before, bool, 30, "the planner's child process")
    assert len(new) == 1, new
    pid = next(iter(new))
    os.kill(pid, signal.SIGKILL)
    return int(pid)


@pytest.fixture
def planner_children() -> Iterator[set[int]]:
    """Every planner child a test saw; each must be gone at its end, whatever the test did."""
    seen: set[int] = set()
    before = _children()
    yield seen
    seen |= _children() - before
    leftover = {pid for pid in seen if psutil.pid_exists(pid)}
    for pid in leftover:  # not left to the next test; this one fails
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not leftover, f"planner children left behind: {leftover}"


def test_a_killed_child_is_retried_after_the_back_off(planner_children: set[int]) -> None:
    planner = auto_planner.Planner(timeout_s=300, retry_s=2)
    slow = _request(**SLOW)
    try:
        before = _children()
        assert isinstance(planner.poll(OWNER, "slow", slow), auto_planner.Pending)
        assert planner.running() == 1
        killed = _kill_the_child(before)
        planner_children.add(killed)

        died = _until(
            lambda: planner.poll(OWNER, "slow", slow),
            lambda o: not isinstance(o, auto_planner.Pending),
            30,
            "the planner to notice its child died",
        )
        # Not a refusal of the inputs: nothing names a field, and it is not cached for good.
        assert not isinstance(died, auto_planner.Failed), died
        assert isinstance(died, auto_planner.Crashed), died
        assert died.code == -signal.SIGKILL and died.retry_in == 2
        assert planner.running() == 0 and _gone({killed})  # reaped, no zombie

        # Within the back-off the same inputs are not planned again: it says when they will be.
        again = planner.poll(OWNER, "slow", slow)
        assert isinstance(again, auto_planner.Crashed), again
        assert again.code == -signal.SIGKILL and 0 < again.retry_in < 2
        assert planner.running() == 0 and not (_children() - before)

        # After it a new child plans the same inputs.
        retried = _until(
            lambda: planner.poll(OWNER, "slow", slow),
            lambda o: not isinstance(o, auto_planner.Crashed),
            10,
            "the retry after the back-off",
        )
        assert isinstance(retried, auto_planner.Pending), retried
        assert planner.running() == 1
        new = _children() - before
        planner_children.update(new)
        assert len(new) == 1 and killed not in new
    finally:
        planner.close()
    assert planner.running() == 0 and _gone(planner_children)


def test_a_child_killed_with_a_plan_pending_is_stopped_by_forget_and_close(
    planner_children: set[int],
) -> None:
    planner = auto_planner.Planner(timeout_s=300, retry_s=3600)
    slow = _request(**SLOW)
    other = ("ns", "y", "u")
    try:
        before = _children()
        planner.poll(OWNER, "slow", slow)
        killed = _kill_the_child(before)
        planner_children.add(killed)
        _until(
            lambda: planner.poll(OWNER, "slow", slow),
            lambda o: isinstance(o, auto_planner.Crashed),
            30,
            "the crash",
        )
        # forget(): the deployment is gone; so is the back-off (a new one plans at once).
        planner.forget(OWNER)
        assert isinstance(planner.poll(OWNER, "slow", slow), auto_planner.Pending)
        planner.poll(other, "slow", slow)
        assert planner.running() == 2
        planner_children.update(_children() - before)
        planner.forget(OWNER)
        assert planner.running() == 1
    finally:
        planner.close()
    assert planner.running() == 0 and _gone(planner_children)


def test_a_refusal_naming_a_field_stays_until_the_inputs_change(
    planner_children: set[int],
) -> None:
    planner = auto_planner.Planner(timeout_s=120, retry_s=0.2)
    bad = _request(gpu="A100", requests=10, policies=["static"])
    try:
        before = _children()
        failed = _until(
            lambda: planner.poll(OWNER, "bad", bad),
            lambda o: not isinstance(o, auto_planner.Pending),
            120,
            "the child's answer",
        )
        assert isinstance(failed, auto_planner.Failed) and failed.field == "spec.policy.auto.gpu"
        planner_children.update(_children() - before)
        time.sleep(0.5)  # past retry_s: a refusal is not retried
        assert planner.poll(OWNER, "bad", bad) == failed and planner.running() == 0
    finally:
        planner.close()


@pytest.fixture(scope="module")
def kube(kmock_api: KmockApi) -> Kube:
    cfg = client.Configuration()
    cfg.host = kmock_api.url
    return Kube(client.ApiClient(cfg))


def _body(name: str) -> dict[str, Any]:
    body = yaml.safe_load((REPO / "docs/examples/auto.yaml").read_text())
    body["metadata"] = cr_metadata(name, NS)
    body["spec"]["model"]["source"] = "/models/llama"  # no Hub
    body["spec"]["policy"]["auto"] = _auto(**SLOW)
    return dict(body)


def _pass(r: Reconciler, body: dict[str, Any]) -> dict[str, Any]:
    return dict(asyncio.run(r.reconcile(copy.deepcopy(body), NOW)))


def _cond(status: dict[str, Any], type_: str) -> dict[str, Any]:
    return condition({"status": status}, type_)


def test_the_deployment_says_the_planner_died_and_when_it_plans_again(
    kube: Kube, planner_children: set[int]
) -> None:
    planner = auto_planner.Planner(timeout_s=300, retry_s=3600)
    settings = OperatorSettings(admin_address="127.0.0.1:1", admin_timeout_seconds=0.3)
    log = logging.getLogger("test")
    body = _body("oom")
    try:
        before = _children()
        r = Reconciler(kube, settings, log, TokenKeeper(kube, None), planner=planner)
        assert _cond(_pass(r, body), "Ready")["reason"] == "Planning"
        planner_children.add(_kill_the_child(before))
        # Nothing runs yet: Ready, Progressing and Degraded say why, naming spec.policy.auto.
        status = _until(
            lambda: _pass(r, body),
            lambda s: _cond(s, "Ready")["reason"] != "Planning",
            30,
            "the pass to see the crash",
        )
        for type_, state in (("Ready", "False"), ("Progressing", "False"), ("Degraded", "True")):
            c = _cond(status, type_)
            assert (c["status"], c["reason"]) == (state, "PlannerCrashed"), c
            assert c["message"].startswith("spec.policy.auto: "), c
            assert "SIGKILL" in c["message"] and "3600 s" in c["message"], c
        assert _cond(status, "InvalidSpec")["status"] == "False"  # not a refusal of the spec
        assert planner.running() == 0

        # With a choice running, it keeps running; status.auto.error and Degraded say why.
        running = {
            "inputs": "older",
            "gpu": "H100",
            "choice": "tp8",
            "policy": {"static": {"tp": 8}},
            "reason": "test",
            "plannedAt": "2026-11-24T00:00:00Z",
            "appliedAt": "2026-11-24T00:00:00Z",
        }
        r = Reconciler(kube, settings, log, TokenKeeper(kube, None), planner=planner)
        status = _pass(r, {**body, "status": {"auto": running}})
        assert status["auto"]["policy"] == running["policy"]
        assert "SIGKILL" in status["auto"]["error"]["message"]
        degraded = _cond(status, "Degraded")
        assert (degraded["status"], degraded["reason"]) == ("True", "PlannerCrashed"), degraded
        assert _cond(status, "InvalidSpec")["status"] == "False"
        assert planner.running() == 0 and not (_children() - before)
    finally:
        planner.close()
    assert _gone(planner_children)


def test_an_exception_in_the_plan_that_names_no_field_is_retried(
    planner_children: set[int],
) -> None:
    """A plan that raises something other than a refusal of a field (a MemoryError, a bug; here
    bytes that are no AutoPolicy) says what it raised and is retried after the back-off, as a
    death is: it is not the inputs' verdict."""
    planner = auto_planner.Planner(timeout_s=60, retry_s=1)
    broken = auto_planner.PlanRequest(b"\xff\xff", "H100", 8, 8, 1, 32768)
    try:
        before = _children()
        raised = _until(
            lambda: planner.poll(OWNER, "broken", broken),
            lambda o: not isinstance(o, auto_planner.Pending),
            60,
            "the plan's answer",
        )
        planner_children.update(_children() - before)
        assert isinstance(raised, auto_planner.Crashed), raised
        assert "DecodeError" in raised.how() and raised.retry_in == 1
        again = planner.poll(OWNER, "broken", broken)
        assert isinstance(again, auto_planner.Crashed) and 0 < again.retry_in <= 1
        time.sleep(1.1)
        assert isinstance(planner.poll(OWNER, "broken", broken), auto_planner.Pending)
    finally:
        planner.close()
