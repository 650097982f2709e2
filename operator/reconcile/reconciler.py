"""One level-triggered reconcile pass of an InferenceDeployment.

Observe (groups, pods, router status) → plan (rollout, restarts, live policy) → act (apply
children, replace pods, call Admin) → report (status). Every pass starts from what is observed,
so a pass repeated, resumed after an operator restart or run by the periodic timer does nothing
new when nothing changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from dataclasses import dataclass, field, replace
from typing import Any

from gearshift.operator.reconcile import (
    auto,
    auto_planner,
    auto_traffic,
    calibration,
    calibration_run,
    model_pin,
    names,
    render_config,
    render_network,
    render_router,
    render_workers,
    restarts,
    rollout,
    status,
)
from gearshift.operator.reconcile.admin_client import AdminClient, AdminUnavailable
from gearshift.operator.reconcile.kube import Kube, KubeError, Snapshot
from gearshift.operator.reconcile.render_meta import is_owned_by
from gearshift.operator.reconcile.settings import OperatorSettings
from gearshift.operator.reconcile.spec import DeploymentSpec, SpecError, parse
from gearshift.operator.reconcile.tokens import TokenKeeper
from gearshift.v1 import policy_fields, policy_pb2, router_pb2
from gearshift.worker.policies import checks

# The router's Admin.GetStatus answer, or None and why not.
RouterRead = tuple[router_pb2.RouterStatus | None, str]

# Listed once per pass; every child of these kinds carries the deployment label.
SNAPSHOT_KINDS = [
    ("apps/v1", "StatefulSet"),
    ("v1", "Service"),
    ("v1", "ConfigMap"),
    ("apps/v1", "Deployment"),
    ("policy/v1", "PodDisruptionBudget"),
    ("v1", "Pod"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
]


@dataclass
class Reconciler:
    kube: Kube
    settings: OperatorSettings
    logger: logging.Logger | logging.LoggerAdapter[logging.Logger]
    # The deployments' tokens (tokens.py); shared across passes (kopf memo) so each Secret is
    # written once per operator process and epoch.
    tokens: TokenKeeper
    # (namespace, name, uid) → the last status.auto planned: a pass that started from a body read
    # before the previous pass wrote its status (a timer and a change handler fire together)
    # reuses it instead of planning again.
    plans: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)
    # hf:// branch or tag → commit (model_pin.py); the Hub, or a fake in tests.
    resolver: model_pin.Resolver = model_pin.hub_resolver
    # policy: auto's plans in child processes (auto_planner.py); None: plan in a thread.
    planner: auto_planner.Planner | None = None
    # (namespace, name, uid) → the calibration key (None: none) the deployment's other
    # calibrations were last let go around (_retire_calibrations); shared across passes (kopf
    # memo) so a pass lists the calibrations only when the key changes.
    calibrations: dict[tuple[str, str, str], str | None] = field(default_factory=dict)

    async def reconcile(self, body: dict[str, Any], now: dt.datetime) -> dict[str, Any]:
        """Converge the children of `body`; returns the status to write."""
        previous = dict(body.get("status") or {})
        meta = body.get("metadata", {})
        try:
            spec, chosen, router_read = await self._runnable(body, previous, now)
            # Off the event loop: it may ask the Hub (bounded by model_pin.RESOLVE_TIMEOUT_S).
            spec, pinned = await asyncio.to_thread(
                model_pin.pin, spec, previous.get("model"), self.resolver
            )
            admin_token = await self.tokens.admin_token(spec)
        except auto.Waiting as wait:  # nothing runs yet: the first plan is not there
            result = status.PassResult(
                replicas=0,
                max_unavailable=1,
                groups=[],
                plan_waiting=wait.message,
                plan_error=wait.message if wait.timed_out else "",
                plan_error_reason=wait.error_reason,
                plan_reason=wait.reason,
            )
            return status.build(
                result,
                name=meta.get("name", ""),
                policy_kind="auto",
                endpoint="",
                generation=int(meta.get("generation", 0)),
                previous=previous,
                now=now,
                auto=wait.status,
                model=previous.get("model"),
            )
        except SpecError as exc:
            owner = (
                str(meta.get("namespace", "")),
                str(meta.get("name", "")),
                str(meta.get("uid", "")),
            )
            if self.planner is not None:
                self.planner.stop(owner)
            result = status.PassResult(
                replicas=0, max_unavailable=1, groups=[], spec_error=str(exc), spec_field=exc.field
            )
            return status.build(
                result,
                name=meta.get("name", ""),
                policy_kind="",
                endpoint="",
                generation=int(meta.get("generation", 0)),
                previous=previous,
                now=now,
                # A pass that renders nothing loses nothing: the model's pin, and auto's
                # running choice with its cooldown and recommendation (the next valid pass
                # decides from them, as if this one had not been).
                auto=self.plans.get(owner) or previous.get("auto"),
                model=previous.get("model"),
            )
        admin = AdminClient(
            self.settings.admin_address_for(spec.name, spec.namespace),
            self.settings.admin_timeout_seconds,
            admin_token,
        )
        # traffic.source: Observed read the router before planning; the same answer serves here.
        router, router_error = router_read or await self._router_status(admin)
        result = await self._converge(
            spec, admin, router, router_error, previous, now, surge_only=chosen is not None
        )
        if chosen is not None and "error" in chosen.status:
            error = chosen.status["error"]["message"]
            result = replace(result, plan_error=error, plan_error_reason=chosen.error_reason)
        kind = policy_fields.kind_of(spec.policy)
        return status.build(
            result,
            name=spec.name,
            policy_kind=f"auto:{kind}" if chosen is not None else kind,
            endpoint=render_router.endpoint(spec, self.settings.cluster_domain),
            generation=spec.generation,
            previous=previous,
            now=now,
            auto=chosen.status if chosen is not None else None,
            model=pinned,
        )

    async def _runnable(
        self, body: dict[str, Any], previous: dict[str, Any], now: dt.datetime
    ) -> tuple[DeploymentSpec, auto.Resolved | None, RouterRead | None]:
        """runnable(), planning off the reconcile path: in the planner's child process (a pass
        polls it and goes on with the running choice), or in a thread without a planner. The
        router's status when traffic.source: Observed read it (None: not read)."""
        parsed = parse(body)
        owner = (parsed.namespace, parsed.name, parsed.uid)
        if not auto.is_auto(parsed):
            self.plans.pop(owner, None)
            if self.planner is not None:
                self.planner.forget(owner)
            await self._retire_calibrations(parsed, None)
            return (*runnable(body, previous, None, now), None)
        nodes = None
        if auto.needs_nodes(parsed):
            try:
                nodes = await self.kube.nodes()
            except KubeError as exc:
                field, why = f"{auto.auto_policy.FIELD}.gpu", "not set, and the nodes"
                if auto.calibrates(parsed):  # it needs their product label for the Job
                    field, why = f"{auto.auto_policy.FIELD}.calibrate", "the nodes"
                raise SpecError(f"{field}: {why} cannot be read ({exc})", field) from exc
        # Ours is newer than a body read before the previous pass wrote its status (a timer and
        # a change handler fire together); the operator is status.auto's only writer.
        before = self.plans.get(owner) or previous.get("auto") or {}
        profile: str | None = None
        if auto.calibrates(parsed):
            gpu = auto.gpu_of(parsed, nodes)
            auto.precheck(parsed, gpu)  # a bad input is refused now, not after the Job's hours
            await self._retire_calibrations(parsed, calibration.key(parsed, gpu))
            retry = self.settings.calibration
            measured = await calibration_run.run(self.kube, parsed, gpu, nodes or [], now, retry)
            if isinstance(measured, calibration_run.Calibrating):
                chosen = auto.hold(parsed, before, measured.message)
                self.plans[owner] = chosen.status
                return checked(chosen.spec, planned=True), chosen, None
            parsed, profile = auto.with_profile(parsed, measured.config_map), measured.text
        else:
            await self._retire_calibrations(parsed, None)
            profile = await self._profile(parsed)
        router_read: RouterRead | None = None
        traffic: auto_traffic.PlanTraffic | None = None
        if auto_traffic.observes(parsed.policy.auto):
            router_read = await self._router_status(await self._admin(parsed))
            traffic = auto_traffic.choose(*router_read, before)
        gpu, key = auto.inputs(parsed, nodes, profile, traffic)
        chosen = await self._plan(parsed, owner, before, gpu, key, now, profile, traffic)
        self.plans[owner] = chosen.status
        if chosen.event is not None:
            self.logger.info("%s", chosen.event.message)
            try:
                stamp = restarts.format_time(now)
                await self.kube.event(
                    body, "Normal", chosen.event.reason, chosen.event.message, stamp
                )
            except KubeError as exc:  # an event is a courtesy; status.auto says the same
                self.logger.warning("could not post the %s event: %s", chosen.event.reason, exc)
        return checked(chosen.spec, planned=True), chosen, router_read

    async def _retire_calibrations(self, spec: DeploymentSpec, keep: str | None) -> None:
        """Let go of the calibrations ``spec`` no longer uses (every one but key ``keep``'s;
        calibration_run.retire), once per key; a failure is logged and tried again next pass."""
        owner = (spec.namespace, spec.name, spec.uid)
        if owner in self.calibrations and self.calibrations[owner] == keep:
            return
        try:
            for line in await calibration_run.retire(
                self.kube, (spec.namespace, spec.name, spec.uid), keep
            ):
                self.logger.info("%s", line)
        except KubeError as exc:
            self.logger.warning("could not let go of unused calibrations: %s", exc)
            return
        self.calibrations[owner] = keep

    async def _admin(self, spec: DeploymentSpec) -> AdminClient:
        return AdminClient(
            self.settings.admin_address_for(spec.name, spec.namespace),
            self.settings.admin_timeout_seconds,
            await self.tokens.admin_token(spec),
        )

    async def _profile(self, spec: DeploymentSpec) -> str | None:
        """The text of the profile ConfigMap ``auto.profile`` names, read each pass (its
        content is in the plan's digest); SpecError naming the field when it cannot be."""
        name = auto.profile_name(spec)
        if name is None:
            return None
        try:
            config_map = await self.kube.get("v1", "ConfigMap", spec.namespace, name)
        except KubeError as exc:
            field = auto.PROFILE_FIELD
            raise SpecError(f"{field}: ConfigMap {name} cannot be read ({exc})", field) from exc
        return auto.profile_text(spec, config_map)

    async def _plan(
        self,
        spec: DeploymentSpec,
        owner: tuple[str, str, str],
        before: dict[str, Any],
        gpu: str,
        key: str,
        now: dt.datetime,
        profile: str | None = None,
        traffic: auto_traffic.PlanTraffic | None = None,
    ) -> auto.Resolved:
        if not auto.needs_plan(before, key):
            return auto.resolve(spec, before, gpu, key, now, traffic=traffic)
        if self.planner is None:
            fresh = await asyncio.to_thread(auto.plan_now, spec, gpu, profile, traffic)
            return auto.resolve(spec, before, gpu, key, now, fresh, traffic)
        outcome = self.planner.poll(owner, key, auto.request(spec, gpu, profile, traffic))
        if isinstance(outcome, auto_planner.Planned):
            return auto.resolve(spec, before, gpu, key, now, outcome.plan, traffic)
        if isinstance(outcome, auto_planner.Failed):
            raise SpecError(outcome.message, outcome.field)
        field = auto.auto_policy.FIELD
        error_reason = "PlannerTimedOut"
        if isinstance(outcome, auto_planner.TimedOut):
            timed_out = True
            message = (
                f"{field}: the plan did not finish within {outcome.seconds:g} s "
                f"(GEARSHIFT_PLAN_TIMEOUT_SECONDS) and was stopped; the same inputs are planned "
                f"again after {self.planner.retry_s:g} s (fewer requests or policies plan faster)"
            )
        elif isinstance(outcome, auto_planner.Crashed):  # not the inputs' fault: retried
            timed_out, error_reason = True, "PlannerCrashed"
            message = (
                f"{field}: the planner's child process "
                + ("failed" if outcome.error else "ended without an answer")
                + f" ({outcome.how()}); the same inputs are planned again after "
                f"{self.planner.retry_s:g} s (GEARSHIFT_PLAN_RETRY_SECONDS)"
            )
        else:
            timed_out = False
            message = f"{field}: planning (in a child process of the operator)"
        note = {"inputs": key, "message": message}
        running = isinstance(before.get("policy"), dict)
        drop = ("planning", "error", "calibrating", "observing")
        kept = {k: v for k, v in before.items() if k not in drop}
        status_auto = {**kept, ("error" if timed_out else "planning"): note}
        if traffic is not None and traffic.observing:
            status_auto["observing"] = {"message": traffic.observing}
        if not running:  # status.auto is the running choice: none yet (the conditions say why)
            raise auto.Waiting(None, message, timed_out, error_reason=error_reason)
        resolved = auto.Resolved(
            auto.with_policy(spec, before["policy"]), status_auto, False, error_reason=error_reason
        )
        try:
            checked(resolved.spec, planned=True)
        except SpecError:  # the running choice does not fit the new group: wait for the plan
            raise auto.Waiting(status_auto, message, timed_out, error_reason=error_reason) from None
        return resolved

    async def _router_status(self, admin: AdminClient) -> RouterRead:
        try:
            return await admin.get_status(), ""
        except AdminUnavailable as exc:
            return None, str(exc)

    async def _converge(
        self,
        spec: DeploymentSpec,
        admin: AdminClient,
        router: router_pb2.RouterStatus | None,
        router_error: str,
        previous: dict[str, Any],
        now: dt.datetime,
        surge_only: bool = False,
    ) -> status.PassResult:
        domain = self.settings.cluster_domain
        reported = {g.name: g for g in router.groups} if router else {}
        snap = await self.kube.snapshot(
            SNAPSHOT_KINDS, spec.namespace, {names.LABEL_DEPLOYMENT: spec.name}
        )
        sets = [
            s
            for s in snap.of_kind("apps/v1", "StatefulSet")
            if is_owned_by(s, spec.name, spec.uid)
            and (s["metadata"].get("labels") or {}).get(names.LABEL_COMPONENT) == "worker"
        ]
        observed = [self._observe(spec, s, reported, router is not None) for s in sets]
        max_unavailable, max_surge = spec.rollout.resolve(spec.replicas)
        if surge_only:
            # policy: auto changes layouts on its own: a new group serves before an old one
            # goes, so the serving groups never drop below replicas (issue 30, item 4).
            max_unavailable, max_surge = 0, max(1, max_surge)
        plan = rollout.plan(observed, spec.replicas, max_unavailable, max_surge)
        kept_surge = sorted(
            {g.index for g in observed if g.surge and g.index >= spec.replicas} - set(plan.delete)
        )
        serving_indices = list(range(spec.replicas)) + kept_surge + plan.create_surge

        await self.kube.apply(render_config.config_map(spec, serving_indices, domain), snap)

        by_index = {g.index: g for g in observed}
        states = status.previous_restarts(previous)
        rolled: set[int] = set()
        for index in plan.create:
            await self._apply_group(spec, snap, index, surge=False)
        for index in plan.create_surge:
            await self._apply_group(spec, snap, index, surge=True)
        for index in plan.roll:
            surge = by_index[index].surge and index >= spec.replicas
            await self._roll_group(spec, snap, admin, index, surge)
            rolled.add(index)
            states[names.group_name(spec.name, index)] = restarts.GroupRestartState()
        for g in observed:
            # Current groups are re-applied (a no-op unless labels moved, e.g. a surge group
            # promoted to base). Outdated ones are left alone until they roll: a template change
            # without replacing all pods would mix revisions inside one group.
            if g.current and g.index not in rolled and g.index not in plan.delete:
                await self._apply_group(
                    spec, snap, g.index, surge=g.surge and g.index >= spec.replicas
                )
        for index in plan.delete:
            await self._delete_group(spec, admin, index)

        await self.kube.apply(render_router.deployment(spec), snap)
        await self.kube.apply(render_router.service(spec), snap)
        await self.kube.apply(render_router.admin_service(spec), snap)
        policy = render_network.router_policy(spec, self.settings.operator, self.settings.dns)
        await self.kube.apply(policy, snap)
        await self.kube.apply(render_workers.disruption_budget(spec), snap)

        reports, gave_up, restarting = await self._restarts(
            spec, snap, admin, observed, states, rolled, plan, reported, now
        )
        policy_error = await self._apply_live_policy(spec, admin, router, observed)
        return status.PassResult(
            replicas=spec.replicas,
            max_unavailable=max_unavailable,
            groups=reports,
            router_error=router_error,
            scaling=bool(plan.create or [i for i in plan.delete if not by_index[i].surge]),
            rolling=bool(plan.roll or plan.create_surge),
            gave_up=gave_up,
            restarting=restarting,
            policy_error=policy_error,
        )

    def _observe(
        self,
        spec: DeploymentSpec,
        sts: dict[str, Any],
        reported: dict[str, router_pb2.GroupStatus],
        router_up: bool,
    ) -> rollout.ObservedGroup:
        labels = sts.get("metadata", {}).get("labels") or {}
        index = int(labels.get(names.LABEL_GROUP_INDEX, "-1"))
        surge = labels.get(names.LABEL_SURGE) == "true"
        desired = render_workers.stateful_set(spec, index, self.settings.cluster_domain, surge)
        name = sts["metadata"]["name"]
        revision = labels.get(names.LABEL_REVISION, "")
        if router_up:
            # A group whose pods were just replaced may still be reported serving for a moment;
            # the revision it reports tells the old pods from the new ones.
            rep = reported.get(name)
            available = (
                rep is not None
                and rep.serving
                and (not rep.stats.revision or rep.stats.revision == revision)
            )
        else:
            ready = int((sts.get("status") or {}).get("readyReplicas") or 0)
            available = ready >= spec.group.nodes
        return rollout.ObservedGroup(
            index=index,
            revision=revision,
            desired_revision=desired["metadata"]["labels"][names.LABEL_REVISION],
            available=available,
            surge=surge,
        )

    async def _apply_group(
        self, spec: DeploymentSpec, snap: Snapshot, index: int, surge: bool
    ) -> None:
        await self.kube.apply(render_workers.headless_service(spec, index), snap)
        await self.kube.apply(render_network.worker_policy(spec, index, self.settings.dns), snap)
        pod_group = render_workers.pod_group(spec, index)
        if pod_group is not None:
            await self.kube.apply(pod_group)
        sts = render_workers.stateful_set(spec, index, self.settings.cluster_domain, surge)
        await self.kube.apply(sts, snap)

    def _group_pods(self, spec: DeploymentSpec, snap: Snapshot, index: int) -> list[dict[str, Any]]:
        group = names.group_name(spec.name, index)
        return [
            p
            for p in snap.of_kind("v1", "Pod")
            if (p["metadata"].get("labels") or {}).get(names.LABEL_GROUP) == group
        ]

    async def _replace_pods(
        self, spec: DeploymentSpec, snap: Snapshot, admin: AdminClient, index: int
    ) -> None:
        """Drain the group at the router (best effort), then delete all its pods at once."""
        group = names.group_name(spec.name, index)
        try:
            await admin.drain(group)
        except AdminUnavailable as exc:
            self.logger.info("drain %s skipped: %s", group, exc)
        for pod in self._group_pods(spec, snap, index):
            await self.kube.delete("v1", "Pod", spec.namespace, pod["metadata"]["name"])

    async def _roll_group(
        self, spec: DeploymentSpec, snap: Snapshot, admin: AdminClient, index: int, surge: bool
    ) -> None:
        self.logger.info(
            "rolling group %s to the current revision", names.group_name(spec.name, index)
        )
        await self._apply_group(spec, snap, index, surge)
        await self._replace_pods(spec, snap, admin, index)

    async def _delete_group(self, spec: DeploymentSpec, admin: AdminClient, index: int) -> None:
        group = names.group_name(spec.name, index)
        with contextlib.suppress(AdminUnavailable):
            await admin.drain(group)
        await self.kube.delete("apps/v1", "StatefulSet", spec.namespace, group)
        await self.kube.delete("v1", "Service", spec.namespace, group)
        await self.kube.delete("networking.k8s.io/v1", "NetworkPolicy", spec.namespace, group)
        pod_group = render_workers.pod_group(spec, index)
        if pod_group is not None:
            await self.kube.delete(pod_group["apiVersion"], "PodGroup", spec.namespace, group)

    async def _restarts(
        self,
        spec: DeploymentSpec,
        snap: Snapshot,
        admin: AdminClient,
        observed: list[rollout.ObservedGroup],
        states: dict[str, restarts.GroupRestartState],
        rolled: set[int],
        plan: rollout.RolloutPlan,
        reported: dict[str, router_pb2.GroupStatus],
        now: dt.datetime,
    ) -> tuple[list[status.GroupReport], list[str], list[str]]:
        reports, gave_up, restarting = [], [], []
        existing = {g.index: g for g in observed if g.index not in plan.delete}
        for index in sorted(set(existing) | set(plan.create) | set(plan.create_surge)):
            g = existing.get(index)
            name = names.group_name(spec.name, index)
            state = states.get(name, restarts.GroupRestartState())
            message = ""
            if g is not None and index not in rolled:
                pods = self._group_pods(spec, snap, index)
                decision = restarts.decide(pods, state, spec.restart, now)
                if decision.action == "restart":
                    self.logger.info("restarting group %s: %s", name, decision.reason)
                    await self._replace_pods(spec, snap, admin, index)
                    state = restarts.GroupRestartState(state.restarts + 1, now)
                    restarting.append(f"{name}: {decision.reason}")
                    message = f"restarted: {decision.reason}"
                elif decision.action == "wait":
                    restarting.append(
                        f"{name}: back-off {decision.wait_seconds:.0f}s ({decision.reason})"
                    )
                    message = f"restart back-off {decision.wait_seconds:.0f}s: {decision.reason}"
                elif decision.action == "give-up":
                    gave_up.append(f"{name}: {decision.reason}")
                    message = decision.reason
                elif g.available and state.restarts and restarts.settled(state, spec.restart, now):
                    state = restarts.GroupRestartState()
                elif not g.available and state.restarts:
                    # Still Degraded until the restarted group serves again.
                    restarting.append(f"{name}: recovering after restart {state.restarts}")
            rep = reported.get(name)
            reports.append(
                status.GroupReport(
                    name=name,
                    index=index,
                    ready=bool(g is not None and g.available and index not in rolled),
                    gear=rep.gear if rep is not None else "",
                    revision=_revision(g, index in rolled),
                    current=g is None or g.current or index in rolled,
                    surge=index >= spec.replicas,
                    restarts=state.restarts,
                    last_restart=state.last_restart,
                    message=message or (rep.message if rep is not None else ""),
                )
            )
        return reports, gave_up, restarting

    async def _apply_live_policy(
        self,
        spec: DeploymentSpec,
        admin: AdminClient,
        router: router_pb2.RouterStatus | None,
        observed: list[rollout.ObservedGroup],
    ) -> str:
        """Send changed live fields to the router when a current, serving group lacks them."""
        if router is None:
            return ""
        desired = spec.full_policy
        current = {names.group_name(spec.name, g.index) for g in observed if g.current}
        stale = [
            g.name
            for g in router.groups
            if g.serving
            and g.name in current
            and _live_differs(g.policy, desired, spec.group.ranks)
        ]
        if not stale:
            return ""
        payload = policy_fields.live_only(desired)
        try:
            response = await admin.apply_policy(payload)
        except AdminUnavailable as exc:
            return f"ApplyPolicy: {exc}"
        self.logger.info("applied live policy to %s: %s", stale, response.applied)
        if not response.applied:
            failed = [f"{r.group}: {r.message}" for r in response.results if not r.applied]
            return "ApplyPolicy refused: " + "; ".join(failed)
        return ""


def runnable(
    body: dict[str, Any],
    previous: dict[str, Any] | None = None,
    nodes: list[dict[str, Any]] | None = None,
    now: dt.datetime | None = None,
    profile_map: dict[str, Any] | None = None,
    router: router_pb2.RouterStatus | None = None,
) -> tuple[DeploymentSpec, auto.Resolved | None]:
    """The parsed spec, with `policy: auto` replaced by its running choice (planned here, in
    this process, when no stored plan matches); SpecError when it is invalid or asks for what
    the engine cannot run. ``profile_map``: the ConfigMap ``auto.profile`` names, when set;
    ``router``: its status, for ``traffic.source: Observed`` (None: not reachable).

    A spec the schema accepts but no worker can run renders no children: its pods could only
    crash-loop (worker/policies/support.py holds the rule, shared with the worker and `serve`).
    """
    spec = parse(body)
    if not auto.is_auto(spec):
        return checked(spec, planned=False), None
    if auto.calibrates(spec):
        field = calibration_run.FIELD
        raise SpecError(f"{field}: runs a profiling Job: only the operator plans it", field)
    before = (previous or {}).get("auto") or {}
    profile = None if auto.profile_name(spec) is None else auto.profile_text(spec, profile_map)
    traffic = None
    if auto_traffic.observes(spec.policy.auto):
        traffic = auto_traffic.choose(router, "not given", before)
    gpu, key = auto.inputs(spec, nodes, profile, traffic)
    fresh = auto.plan_now(spec, gpu, profile, traffic) if auto.needs_plan(before, key) else None
    at = now or dt.datetime.now(dt.UTC)
    chosen = auto.resolve(spec, before, gpu, key, at, fresh, traffic)
    return checked(chosen.spec, planned=True), chosen


def checked(spec: DeploymentSpec, planned: bool) -> DeploymentSpec:
    """``spec`` if its policy (``planned``: auto's choice) runs on its group; SpecError naming
    the field if not (``auto.layout_error``)."""
    error = auto.layout_error(spec, planned)
    if error is not None:
        raise error
    return spec


def runnable_spec(
    body: dict[str, Any], nodes: list[dict[str, Any]] | None = None
) -> DeploymentSpec:
    """runnable() without the auto choice's status (plans afresh for `policy: auto`)."""
    return runnable(body, None, nodes)[0]


def _live_differs(reported: policy_pb2.Policy, desired: policy_pb2.Policy, ranks: int) -> bool:
    full = checks.with_defaults(reported, ranks)
    if policy_fields.kind_of(full) != policy_fields.kind_of(desired):
        return False  # a different layout: the group rolls instead
    changed = policy_fields.changed_fields(full, desired)
    return bool(changed) and not policy_fields.non_live_changes(full, desired)


def _revision(group: rollout.ObservedGroup | None, rolled: bool) -> str:
    if group is None:
        return ""
    return group.desired_revision if group.current or rolled else group.revision
