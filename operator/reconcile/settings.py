"""Operator settings, from the environment (the chart sets them)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from gearshift.operator.reconcile import names
from gearshift.operator.reconcile.calibration_retry import CalibrationRetry
from gearshift.operator.reconcile.render_network import DnsPeer, OperatorPeer

DEFAULT_ADMIN_ADDRESS = "{router_admin}.{namespace}.svc.{cluster_domain}:{port}"


@dataclass(frozen=True)
class OperatorSettings:
    cluster_domain: str = "cluster.local"
    # Where the operator reaches each deployment's router Admin API. A template over {name},
    # {namespace}, {router_admin}, {cluster_domain}, {port}; tests point it at a loopback router.
    admin_address: str = DEFAULT_ADMIN_ADDRESS
    admin_timeout_seconds: float = 3.0
    # Level-triggered resync: every pass re-reads children, router status and pods.
    resync_seconds: float = 10.0
    # Who may call each router's Admin API (its NetworkPolicy): the operator's namespace and
    # pod labels, from the chart.
    operator: OperatorPeer = field(default_factory=OperatorPeer)
    # The cluster DNS pods every deployment's pods may query (their NetworkPolicies' egress).
    dns: DnsPeer = field(default_factory=DnsPeer)
    # The file holding the key every deployment's tokens derive from (tokens.py; the chart
    # mounts it from a Secret); "": a key of this process only.
    key_file: str = ""
    # policy: auto: a plan running longer is stopped (PlannerTimedOut), and the same inputs are
    # planned again after plan_retry_seconds (auto_planner.py), as after a planner child that
    # died without answering (PlannerCrashed, e.g. the OOM killer).
    plan_timeout_seconds: float = 300.0
    plan_retry_seconds: float = 600.0
    # auto.calibrate: a failed profiling Job is deleted and created again after a backoff that
    # doubles from the first value up to the cap, for at most this many attempts in all
    # (calibration_retry.py).
    calibration: CalibrationRetry = field(default_factory=CalibrationRetry)

    def admin_address_for(self, name: str, namespace: str) -> str:
        return self.admin_address.format(
            name=name,
            namespace=namespace,
            router_admin=names.router_admin_service(name),
            cluster_domain=self.cluster_domain,
            port=names.ROUTER_ADMIN_PORT,
        )

    @staticmethod
    def from_env(env: dict[str, str] | None = None) -> OperatorSettings:
        e = os.environ if env is None else env
        return OperatorSettings(
            cluster_domain=e.get("GEARSHIFT_CLUSTER_DOMAIN", "cluster.local"),
            admin_address=e.get("GEARSHIFT_ROUTER_ADMIN_ADDRESS", DEFAULT_ADMIN_ADDRESS),
            admin_timeout_seconds=float(e.get("GEARSHIFT_ADMIN_TIMEOUT_SECONDS", "3")),
            resync_seconds=float(e.get("GEARSHIFT_RESYNC_SECONDS", "10")),
            key_file=e.get("GEARSHIFT_OPERATOR_KEY_FILE", ""),
            plan_timeout_seconds=float(e.get("GEARSHIFT_PLAN_TIMEOUT_SECONDS", "300")),
            plan_retry_seconds=float(e.get("GEARSHIFT_PLAN_RETRY_SECONDS", "600")),
            calibration=CalibrationRetry(
                attempts=int(e.get("GEARSHIFT_CALIBRATION_ATTEMPTS", "3")),
                backoff_s=float(e.get("GEARSHIFT_CALIBRATION_BACKOFF_SECONDS", "300")),
                max_backoff_s=float(e.get("GEARSHIFT_CALIBRATION_BACKOFF_MAX_SECONDS", "3600")),
            ),
            dns=DnsPeer(parse_labels(e.get("GEARSHIFT_DNS_LABELS", "")) or DnsPeer().labels),
            operator=OperatorPeer(
                namespace=e.get("GEARSHIFT_OPERATOR_NAMESPACE", ""),
                labels=parse_labels(e.get("GEARSHIFT_OPERATOR_LABELS", "")),
            ),
        )


def parse_labels(text: str) -> dict[str, str]:
    """`k=v,k2=v2` (a label selector's equality form) into a dict."""
    out = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"labels: {item!r} is not key=value")
        out[key.strip()] = value.strip()
    return out
