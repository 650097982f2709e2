"""Admin ApplyPolicy changes the shift threshold live; /metrics and GetStatus show it."""

from __future__ import annotations

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

from gearshift.v1 import policy_pb2, router_pb2, router_pb2_grpc
from tests.e2e.conftest import API_KEY, status
from tests.e2e.serve_process import ServeProcess, wait_for

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
# Every metric the issue names, plus the gear metrics (docs/metrics.md).
REQUIRED = [
    "gearshift_time_to_first_token_seconds",
    "gearshift_inter_token_latency_seconds",
    "gearshift_request_time_per_output_token_seconds",
    "gearshift_e2e_request_latency_seconds",
    "gearshift_request_queue_time_seconds",
    "gearshift_num_requests_running",
    "gearshift_num_requests_waiting",
    "gearshift_kv_cache_usage_perc",
    "gearshift_prompt_tokens",
    "gearshift_generation_tokens",
    "gearshift_request_success",
    "gearshift_gear",
    "gearshift_gear_switches",
    "gearshift_gear_steps",
    "gearshift_gear_tokens",
    "gearshift_policy_parameter",
]


def _apply(serve: ServeProcess, threshold: int) -> router_pb2.AdminApplyPolicyResponse:
    policy = policy_pb2.Policy(shift=policy_pb2.ShiftPolicy(threshold=threshold))
    with grpc.insecure_channel(serve.admin_address) as channel:
        return router_pb2_grpc.AdminStub(channel).ApplyPolicy(
            router_pb2.AdminApplyPolicyRequest(policy=policy), timeout=10, metadata=serve.metadata
        )


def _metrics(serve: ServeProcess) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = httpx.get(f"{serve.url}/metrics", timeout=10).text
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(family.name, []).append((dict(sample.labels), sample.value))
    return out


def _generate(serve: ServeProcess, prompt_words: int) -> None:
    r = httpx.post(
        f"{serve.url}/v1/completions",
        headers=HEADERS,
        timeout=60,
        json={
            "model": "smollm2",
            "prompt": "word " * prompt_words,
            "max_tokens": 3,
            "temperature": 0,
        },
    )
    assert r.status_code == 200, r.text


def _gear_steps(serve: ServeProcess, gear: str) -> float:
    return sum(v for labels, v in _metrics(serve)["gearshift_gear_steps"] if labels["gear"] == gear)


def test_apply_policy_changes_the_threshold_live_and_gears_follow(serve: ServeProcess) -> None:
    # Threshold 0: every step has more scheduled tokens, so the base (SP) gear runs.
    response = _apply(serve, 0)
    assert response.applied, response
    assert {r.policy.shift.threshold for r in response.results} == {0}
    assert all(g.policy.shift.threshold == 0 for g in status(serve).groups)
    base = _gear_steps(serve, "base")
    for _ in range(2):  # least-outstanding routing alternates: both groups see a request
        _generate(serve, 4)
    wait_for(lambda: _gear_steps(serve, "base") >= base + 6, 10, "base gear steps")
    # A huge threshold: every step runs the shift (TP) gear; no restart in between.
    pids = {g["name"]: g["pid"] for g in serve.info["groups"]}
    assert _apply(serve, 100_000).applied
    shift = _gear_steps(serve, "shift")
    _generate(serve, 4)
    wait_for(lambda: _gear_steps(serve, "shift") >= shift + 3, 10, "shift gear steps")
    metrics = _metrics(serve)
    thresholds = {
        labels["group"]: v
        for labels, v in metrics["gearshift_policy_parameter"]
        if labels["parameter"] == "shift.threshold"
    }
    assert thresholds == {name: 100_000.0 for name in pids}
    assert any(labels["gear"] == "shift" and v == 1.0 for labels, v in metrics["gearshift_gear"])
    assert sum(v for _, v in metrics["gearshift_gear_switches"]) >= 1
    assert {g.name: g.stats.revision for g in status(serve).groups} == dict.fromkeys(pids, "")
    assert _apply(serve, 256).applied


def test_apply_policy_refuses_a_layout_change_naming_the_field(serve: ServeProcess) -> None:
    policy = policy_pb2.Policy(shift=policy_pb2.ShiftPolicy(sp=2))
    with grpc.insecure_channel(serve.admin_address) as channel:
        response = router_pb2_grpc.AdminStub(channel).ApplyPolicy(
            router_pb2.AdminApplyPolicyRequest(policy=policy), timeout=10, metadata=serve.metadata
        )
    assert not response.applied
    assert all("shift.sp" in r.message and not r.applied for r in response.results)
    assert all(g.policy.shift.sp == 1 for g in status(serve).groups)


def test_metrics_parse_and_every_metric_has_a_sample_after_traffic(serve: ServeProcess) -> None:
    _generate(serve, 3)
    metrics = _metrics(serve)
    # The parser strips _total from counter families; histograms expose _count/_sum/_bucket.
    names = set(metrics)
    missing = [m for m in REQUIRED if m not in names]
    assert not missing, missing
    assert all(metrics[m] for m in REQUIRED)
    ttft = {labels.get("le"): v for labels, v in metrics["gearshift_time_to_first_token_seconds"]}
    assert ttft["+Inf"] >= 1
    # max_tokens 3 on a 3-word prompt ends by length; other reasons appear only when traffic
    # produces them (tests/router/test_router_metrics.py), never pre-created.
    lengths = [
        v
        for labels, v in metrics["gearshift_request_success"]
        if labels["finished_reason"] == "length"
    ]
    assert lengths and lengths[0] >= 1
