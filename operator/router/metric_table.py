"""Every metric the router exports, as data: name, type, help text, labels and buckets.

``metrics.py`` builds the instruments and the per-group families from these rows; docs/metrics.md
lists the same names, types and labels (tests/router/test_metric_table.py checks both ways). A
counter's exposed name has ``_total`` appended, as Prometheus does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["histogram", "counter", "gauge"]
M = ("model_name",)
G = ("model_name", "group")

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), so dashboards carry over.
# fmt: off
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)
LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
# fmt: on


@dataclass(frozen=True)
class MetricSpec:
    """One metric: ``key`` names it in the code (a RouterMetrics attribute, a family's key)."""

    key: str
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = M
    buckets: tuple[float, ...] = ()  # histograms only


# Observed by the router as requests finish (RouterMetrics.observe_finished and the routes).
REQUEST_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "ttft",
        "gearshift_time_to_first_token_seconds",
        "histogram",
        "Time to first token: from the router receiving the request to its first token.",
        buckets=TTFT_BUCKETS,
    ),
    MetricSpec(
        "itl",
        "gearshift_inter_token_latency_seconds",
        "histogram",
        "Time between two consecutive output tokens of a request.",
        buckets=ITL_BUCKETS,
    ),
    MetricSpec(
        "tpot",
        "gearshift_request_time_per_output_token_seconds",
        "histogram",
        "Per request: decode time over output tokens after the first.",
        buckets=ITL_BUCKETS,
    ),
    MetricSpec(
        "e2e",
        "gearshift_e2e_request_latency_seconds",
        "histogram",
        "End-to-end request latency at the router.",
        buckets=LATENCY_BUCKETS,
    ),
    MetricSpec(
        "queue",
        "gearshift_request_queue_time_seconds",
        "histogram",
        "Time a request waited in the worker's queue before its first step.",
        buckets=LATENCY_BUCKETS,
    ),
    MetricSpec(
        "prompt_len",
        "gearshift_request_prompt_tokens",
        "histogram",
        "Prompt tokens per finished request.",
        buckets=TOKEN_BUCKETS,
    ),
    MetricSpec(
        "generation_len",
        "gearshift_request_generation_tokens",
        "histogram",
        "Output tokens per finished request.",
        buckets=TOKEN_BUCKETS,
    ),
    MetricSpec(
        "prompt_tokens",
        "gearshift_prompt_tokens",
        "counter",
        "Prompt tokens of finished requests.",
    ),
    MetricSpec(
        "generation_tokens",
        "gearshift_generation_tokens",
        "counter",
        "Output tokens of finished requests.",
    ),
    MetricSpec(
        "request_success",
        "gearshift_request_success",
        "counter",
        "Finished requests by finish reason (stop, length, abort, error).",
        (*M, "finished_reason"),
    ),
    MetricSpec(
        "rejected",
        "gearshift_requests_rejected",
        "counter",
        "Every 4xx/5xx answer of the client APIs, by HTTP status and reason.",
        (*M, "status", "reason"),
    ),
    MetricSpec(
        "retries",
        "gearshift_request_retries",
        "counter",
        "Requests re-sent to another group after theirs failed before the first token.",
    ),
    MetricSpec(
        "group_restarts",
        "gearshift_group_restarts",
        "counter",
        "Worker groups restarted after they died (gearshift serve; the operator reports "
        "restarts in the InferenceDeployment's status).",
        (*M, "group"),
    ),
    # Tetris (§5.1-5.2): what the router's planner decided for each request it sent.
    MetricSpec(
        "tetris_chunks",
        "gearshift_tetris_plan_chunks",
        "histogram",
        "Chunks per request in the Tetris planner's CDSP plans.",
        buckets=(1, 2, 3, 4, 6, 8),
    ),
    MetricSpec(
        "tetris_chunk_sp",
        "gearshift_tetris_chunk_sp_size",
        "histogram",
        "SP size (prefill instances) of each planned CDSP chunk.",
        buckets=(1, 2, 4, 8, 16, 32, 64, 128),
    ),
    MetricSpec(
        "tetris_planned_prefill",
        "gearshift_tetris_planned_prefill_seconds",
        "histogram",
        "The planner's Eq. (1) estimate of each request's prefill, queueing included.",
        buckets=TTFT_BUCKETS,
    ),
    MetricSpec(
        "tetris_improvement_rate",
        "gearshift_tetris_improvement_rate",
        "histogram",
        "Algorithm 2's improvement rate each plan was made with, by where it came from "
        "(policy_constant, policy_table, profiled, default).",
        (*M, "source"),
        buckets=(0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 1.0),
    ),
    MetricSpec(
        "tetris_placements",
        "gearshift_tetris_decode_placements",
        "counter",
        "Requests planned onto each decode instance.",
        (*M, "decode_instance"),
    ),
)

# Read from each group's last GetStats at scrape time (metrics.GroupCollector).
GROUP_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "serving", "gearshift_group_serving", "gauge", "1 while the group takes new requests.", G
    ),
    MetricSpec(
        "running", "gearshift_num_requests_running", "gauge", "Requests in the running batch.", G
    ),
    MetricSpec(
        "waiting", "gearshift_num_requests_waiting", "gauge", "Requests waiting in the queue.", G
    ),
    MetricSpec(
        "kv",
        "gearshift_kv_cache_usage_perc",
        "gauge",
        "Fraction of KV cache blocks in use (0-1).",
        G,
    ),
    MetricSpec(
        "in_flight",
        "gearshift_router_requests_in_flight",
        "gauge",
        "Requests this router has in flight on the group.",
        G,
    ),
    MetricSpec(
        "queued",
        "gearshift_router_requests_queued",
        "gauge",
        "Requests waiting in this router for room on the group (Tetris: a decode instance "
        "with their KV slots free), oldest first; counted in requests in flight too.",
        G,
    ),
    MetricSpec(
        "outstanding",
        "gearshift_outstanding_tokens",
        "gauge",
        "Tokens accepted and not yet computed (the routing load measure).",
        G,
    ),
    MetricSpec(
        "gear",
        "gearshift_gear",
        "gauge",
        "1 for the gear that ran the group's last step, 0 for its other gears.",
        (*G, "gear"),
    ),
    MetricSpec(
        "switches",
        "gearshift_gear_switches",
        "counter",
        "Gear switches since the worker started.",
        G,
    ),
    MetricSpec(
        "steps", "gearshift_gear_steps", "counter", "Engine steps run per gear.", (*G, "gear")
    ),
    MetricSpec(
        "tokens", "gearshift_gear_tokens", "counter", "Tokens computed per gear.", (*G, "gear")
    ),
    MetricSpec(
        "preemptions", "gearshift_num_preemptions", "counter", "Requests preempted (recomputed).", G
    ),
    MetricSpec(
        "policy_stat",
        "gearshift_policy_stat",
        "gauge",
        "Policy-specific figures of the group (its policy's stats; docs/metrics.md).",
        (*G, "stat"),
    ),
    MetricSpec(
        "policy",
        "gearshift_policy_parameter",
        "gauge",
        "Numeric parameters of the group's active policy (live ones change at run time).",
        (*G, "parameter"),
    ),
)
