"""``policy: auto``'s plans, off the reconcile path (issue 30, item 4).

A plan takes seconds to minutes of CPU. Each runs in a child process of its own (spawned: the
operator's event loop and client threads are not forked), one per deployment, and the reconcile
pass only polls it: a pass never waits on a plan. A child still running after the timeout is
killed (a thread could not be) and the deployment reports ``PlannerTimedOut``; the same inputs
are tried again after ``retry_s``. A child that dies without answering (the OOM killer's SIGKILL, a
crash) is reported as ``PlannerCrashed`` and retried after the same ``retry_s``: its death says
nothing about the inputs. Only the child's own answer naming a field at fault (``Failed``) stays
until the inputs change. A newer set of inputs for the same deployment kills the older child: its
answer would be stale on arrival.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import time
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

Owner = tuple[str, str, str]  # namespace, name, uid


@dataclass(frozen=True)
class PlanRequest:
    """What a child plans from: the AutoPolicy (serialized), the GPU, the group's shape,
    with ``auto.profile`` the profile's text (read from its ConfigMap by the operator), and
    observed traffic figures."""

    auto: bytes
    gpu: str
    gpus: int
    gpus_per_node: int
    replicas: int
    max_model_len: int | None
    profile: str | None = None
    # traffic.source: Observed: the router's figures to plan from (auto_traffic.py); None:
    # the declared traffic.
    traffic: dict[str, Any] | None = None
    dtype: str = "auto"  # spec.model.dtype: the one a profile must have measured


@dataclass(frozen=True)
class Pending:
    seconds: float  # how long it has run


@dataclass(frozen=True)
class Planned:
    plan: dict[str, Any]  # choice, policy, reason, predicted, considered, pricing


@dataclass(frozen=True)
class Failed:
    field: str
    message: str


@dataclass(frozen=True)
class TimedOut:
    seconds: float  # the timeout it ran past
    retry_in: float  # seconds until the same inputs are planned again


@dataclass(frozen=True)
class Crashed:
    """The child ended without an answer: killed by a signal (the OOM killer's SIGKILL) or
    crashed. Retried like a timeout: the same inputs may well plan on the next try."""

    code: int | None  # its exit code: -N for signal N, None when it could not be read
    retry_in: float  # seconds until the same inputs are planned again
    # An exception the plan raised that names no field (a MemoryError, a bug): not the inputs'
    # fault as far as anyone can tell, so retried as a death is.
    error: str = ""

    def how(self) -> str:
        """How it ended, e.g. "killed by SIGKILL (e.g. the out-of-memory killer)"."""
        if self.error:
            return f"the plan raised {self.error}"
        if self.code is None:
            return "exit code unknown"
        if self.code >= 0:
            return f"exit code {self.code}"
        try:
            name = signal.Signals(-self.code).name
        except ValueError:
            name = f"signal {-self.code}"
        oom = " (e.g. the out-of-memory killer)" if -self.code == signal.SIGKILL else ""
        return f"killed by {name}{oom}"


Outcome = Pending | Planned | Failed | TimedOut | Crashed


def run_plan(request: PlanRequest) -> Planned | Failed:
    """The plan itself (in the child; also callable in-process)."""
    from gearshift.operator.sim import auto_policy
    from gearshift.v1 import policy_pb2

    shape = auto_policy.GroupShape(
        request.gpus, request.gpus_per_node, request.replicas, request.max_model_len
    )
    try:
        auto = policy_pb2.AutoPolicy.FromString(request.auto)
        choice = auto_policy.choose(
            auto, request.gpu, shape, request.profile, request.traffic, request.dtype
        )
    except auto_policy.AutoError as exc:
        return Failed(exc.field, str(exc))
    plan = Planned(
        {
            "choice": choice.candidate,
            "policy": choice.policy,
            "reason": choice.reason,
            "predicted": {k: v for k, v in choice.predicted.items() if v is not None},
            "considered": [
                {k: v for k, v in line.items() if v is not None} for line in choice.considered
            ],
            "pricing": choice.pricing,
        }
    )
    if choice.profile is not None:
        plan.plan["profile"] = choice.profile
    return plan


def _child(conn: Connection, request: PlanRequest) -> None:
    try:
        answer: Planned | Failed | Crashed = run_plan(request)
    except Exception as exc:  # noqa: BLE001 (the child's last word; else the parent sees EOF)
        answer = Crashed(None, 0.0, error=repr(exc))
    conn.send(answer)
    conn.close()


@dataclass
class _Job:
    key: str
    process: BaseProcess
    conn: Connection
    started: float


@dataclass
class Planner:
    """One plan in flight per deployment; ``poll`` starts it, reports it and reaps it."""

    timeout_s: float
    retry_s: float
    _jobs: dict[Owner, _Job] = field(default_factory=dict)
    # The last finished outcome per deployment: (inputs key, outcome, monotonic end time).
    _ended: dict[Owner, tuple[str, Outcome, float]] = field(default_factory=dict)

    def poll(self, owner: Owner, key: str, request: PlanRequest) -> Outcome:
        """The plan of ``key`` for ``owner``: started if new, its answer once there."""
        now = time.monotonic()
        ended = self._ended.get(owner)
        if ended is not None and ended[0] == key:
            outcome = ended[1]
            if not isinstance(outcome, TimedOut | Crashed):
                return outcome  # an answer: the same inputs get the same one
            wait = self.retry_s - (now - ended[2])
            if wait > 0:
                return replace(outcome, retry_in=wait)
            del self._ended[owner]
        job = self._jobs.get(owner)
        if job is not None and job.key != key:
            self._stop(owner)
            job = None
        if job is None:
            job = self._start(key, request)
            self._jobs[owner] = job
        return self._check(owner, job, now)

    def _start(self, key: str, request: PlanRequest) -> _Job:
        ctx = multiprocessing.get_context("spawn")
        receive, send = ctx.Pipe(duplex=False)
        process = ctx.Process(target=_child, args=(send, request), daemon=True)
        process.start()
        send.close()  # the child holds its end: EOF here once it exits
        return _Job(key, process, receive, time.monotonic())

    def _check(self, owner: Owner, job: _Job, now: float) -> Outcome:
        outcome: Outcome | None = None
        if job.conn.poll(0):
            # EOF: it ended without a word (killed, crashed); outcome stays None.
            with contextlib.suppress(EOFError, OSError):
                outcome = job.conn.recv()
        elif now - job.started > self.timeout_s:
            outcome = TimedOut(self.timeout_s, self.retry_s)
        else:
            return Pending(now - job.started)
        self._stop(owner)  # reaped: its exit code is known
        if outcome is None:
            outcome = Crashed(job.process.exitcode, self.retry_s)
        elif isinstance(outcome, Crashed):  # the child's own report of an exception
            outcome = replace(outcome, code=job.process.exitcode, retry_in=self.retry_s)
        self._ended[owner] = (job.key, outcome, now)
        return outcome

    def _stop(self, owner: Owner) -> None:
        job = self._jobs.pop(owner, None)
        if job is None:
            return
        if job.process.is_alive():
            job.process.kill()
        job.process.join(5)
        job.conn.close()

    def forget(self, owner: Owner) -> None:
        """The deployment is gone: stop its plan and drop what is remembered."""
        self._stop(owner)
        self._ended.pop(owner, None)

    def close(self) -> None:
        for owner in list(self._jobs):
            self._stop(owner)

    def running(self) -> int:
        return len(self._jobs)

    def stop(self, owner: Owner) -> None:
        """Stop the deployment's plan in flight, if any (its spec no longer parses, so no pass
        polls it: nothing would enforce its timeout); finished outcomes are kept."""
        self._stop(owner)
