"""Prometheus metrics with vLLM's meanings, named `gearshift_*` (docs/metrics.md).

Request histograms and token counters are observed here as requests finish; per-group gauges and
counters (running, waiting, KV usage, gears) are read from the latest worker stats at scrape time
by a collector, so they never drift from what the workers report.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from google.protobuf.descriptor import FieldDescriptor
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gearshift.operator.router.group import Group
from gearshift.operator.router.trace_recorder import TraceRecorder
from gearshift.v1 import policy_fields, policy_pb2, worker_pb2

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), so dashboards carry over.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)


class RouterMetrics:
    """Every metric of one router process, in its own registry."""

    def __init__(self, model_name: str, groups: Callable[[], Iterable[Group]]) -> None:
        self.model_name = model_name
        # --record-trace: every finished request also goes to this file (trace_recorder.py).
        self.trace: TraceRecorder | None = None
        self.registry = CollectorRegistry(auto_describe=True)
        r, m = self.registry, ["model_name"]
        self.ttft = Histogram(
            "gearshift_time_to_first_token_seconds",
            "Time to first token: from the router receiving the request to its first token.",
            m,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "gearshift_inter_token_latency_seconds",
            "Time between two consecutive output tokens of a request.",
            m,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "gearshift_request_time_per_output_token_seconds",
            "Per request: decode time over output tokens after the first.",
            m,
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "gearshift_e2e_request_latency_seconds",
            "End-to-end request latency at the router.",
            m,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "gearshift_request_queue_time_seconds",
            "Time a request waited in the worker's queue before its first step.",
            m,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_len = Histogram(
            "gearshift_request_prompt_tokens",
            "Prompt tokens per finished request.",
            m,
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.generation_len = Histogram(
            "gearshift_request_generation_tokens",
            "Output tokens per finished request.",
            m,
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "gearshift_prompt_tokens", "Prompt tokens of finished requests.", m, registry=r
        )
        self.generation_tokens = Counter(
            "gearshift_generation_tokens", "Output tokens of finished requests.", m, registry=r
        )
        self.request_success = Counter(
            "gearshift_request_success",
            "Finished requests by finish reason (stop, length, abort, error).",
            [*m, "finished_reason"],
            registry=r,
        )
        self.rejected = Counter(
            "gearshift_requests_rejected",
            "Every 4xx/5xx answer of the client APIs, by HTTP status and reason.",
            [*m, "status", "reason"],
            registry=r,
        )
        self.retries = Counter(
            "gearshift_request_retries",
            "Requests re-sent to another group after theirs failed before the first token.",
            m,
            registry=r,
        )
        self.group_restarts = Counter(
            "gearshift_group_restarts",
            "Worker groups restarted after they died (gearshift serve; the operator reports "
            "restarts in the InferenceDeployment's status).",
            [*m, "group"],
            registry=r,
        )
        # Tetris (§5.1-5.2): what the router's planner decided for each request it sent.
        self.tetris_chunks = Histogram(
            "gearshift_tetris_plan_chunks",
            "Chunks per request in the Tetris planner's CDSP plans.",
            m,
            buckets=(1, 2, 3, 4, 6, 8),
            registry=r,
        )
        self.tetris_chunk_sp = Histogram(
            "gearshift_tetris_chunk_sp_size",
            "SP size (prefill instances) of each planned CDSP chunk.",
            m,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        )
        self.tetris_planned_prefill = Histogram(
            "gearshift_tetris_planned_prefill_seconds",
            "The planner's Eq. (1) estimate of each request's prefill, queueing included.",
            m,
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tetris_placements = Counter(
            "gearshift_tetris_decode_placements",
            "Requests planned onto each decode instance.",
            [*m, "decode_instance"],
            registry=r,
        )
        self.registry.register(GroupCollector(model_name, groups))

    def observe_tetris_plan(self, plan: worker_pb2.TetrisPlan) -> None:
        """One request's Tetris plan as the router sent it."""
        name = self.model_name
        self.tetris_chunks.labels(name).observe(len(plan.chunks))
        for chunk in plan.chunks:
            self.tetris_chunk_sp.labels(name).observe(len(chunk.prefill_instances))
        self.tetris_planned_prefill.labels(name).observe(plan.planned_prefill_seconds)
        self.tetris_placements.labels(name, str(plan.decode_instance)).inc()

    def reject(self, status: int, reason: str) -> None:
        """One refused request (rejections.py calls this for every 4xx/5xx answer)."""
        self.rejected.labels(self.model_name, str(status), reason).inc()

    def observe_finished(
        self,
        *,
        finish_reason: str,
        prompt_tokens: int,
        output_tokens: int,
        e2e: float,
        ttft: float | None,
        decode_time: float | None,
        queue_time: float | None,
    ) -> None:
        name = self.model_name
        self.request_success.labels(name, finish_reason).inc()
        self.prompt_tokens.labels(name).inc(prompt_tokens)
        self.generation_tokens.labels(name).inc(output_tokens)
        self.prompt_len.labels(name).observe(prompt_tokens)
        self.generation_len.labels(name).observe(output_tokens)
        self.e2e.labels(name).observe(e2e)
        if ttft is not None:
            self.ttft.labels(name).observe(ttft)
        if decode_time is not None and output_tokens > 1:
            self.tpot.labels(name).observe(decode_time / (output_tokens - 1))
        if queue_time is not None:
            self.queue.labels(name).observe(max(0.0, queue_time))
        if self.trace is not None:
            # Both callers measure e2e on the monotonic clock, from the request's arrival.
            self.trace.record(time.monotonic() - e2e, prompt_tokens, output_tokens, finish_reason)


class GroupCollector(Collector):
    """Per-group gauges and counters from each group's last GetStats answer."""

    def __init__(self, model_name: str, groups: Callable[[], Iterable[Group]]) -> None:
        self.model_name = model_name
        self.groups = groups

    def describe(self) -> Iterable[Metric]:
        return []  # dynamic label sets: let the registry collect instead

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "group"]
        fams: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            "serving": GaugeMetricFamily(
                "gearshift_group_serving", "1 while the group takes new requests.", labels=labels
            ),
            "running": GaugeMetricFamily(
                "gearshift_num_requests_running", "Requests in the running batch.", labels=labels
            ),
            "waiting": GaugeMetricFamily(
                "gearshift_num_requests_waiting", "Requests waiting in the queue.", labels=labels
            ),
            "kv": GaugeMetricFamily(
                "gearshift_kv_cache_usage_perc",
                "Fraction of KV cache blocks in use (0-1).",
                labels=labels,
            ),
            "in_flight": GaugeMetricFamily(
                "gearshift_router_requests_in_flight",
                "Requests this router has in flight on the group.",
                labels=labels,
            ),
            "outstanding": GaugeMetricFamily(
                "gearshift_outstanding_tokens",
                "Tokens accepted and not yet computed (the routing load measure).",
                labels=labels,
            ),
            "gear": GaugeMetricFamily(
                "gearshift_gear",
                "1 for the gear that ran the group's last step, 0 for its other gears.",
                labels=[*labels, "gear"],
            ),
            "switches": CounterMetricFamily(
                "gearshift_gear_switches", "Gear switches since the worker started.", labels=labels
            ),
            "steps": CounterMetricFamily(
                "gearshift_gear_steps", "Engine steps run per gear.", labels=[*labels, "gear"]
            ),
            "tokens": CounterMetricFamily(
                "gearshift_gear_tokens", "Tokens computed per gear.", labels=[*labels, "gear"]
            ),
            "preemptions": CounterMetricFamily(
                "gearshift_num_preemptions", "Requests preempted (recomputed).", labels=labels
            ),
            "policy_stat": GaugeMetricFamily(
                "gearshift_policy_stat",
                "Policy-specific figures of the group (its policy's stats; docs/metrics.md).",
                labels=[*labels, "stat"],
            ),
            "policy": GaugeMetricFamily(
                "gearshift_policy_parameter",
                "Numeric parameters of the group's active policy (live ones change at run time).",
                labels=[*labels, "parameter"],
            ),
        }
        for g in self.groups():
            lv = [self.model_name, g.name]
            fams["serving"].add_metric(lv, 1.0 if g.serving else 0.0)
            fams["in_flight"].add_metric(lv, g.load.in_flight)
            s = g.stats
            if s is None:
                continue
            fams["running"].add_metric(lv, s.running)
            fams["waiting"].add_metric(lv, s.waiting)
            fams["kv"].add_metric(lv, s.kv_usage)
            fams["outstanding"].add_metric(lv, s.outstanding_tokens)
            fams["switches"].add_metric(lv, s.gear_switches)
            fams["preemptions"].add_metric(lv, s.preemptions)
            for gear in s.gears:
                fams["gear"].add_metric([*lv, gear.name], 1.0 if gear.name == s.gear else 0.0)
                fams["steps"].add_metric([*lv, gear.name], gear.steps)
                fams["tokens"].add_metric([*lv, gear.name], gear.tokens)
            for stat, value in sorted(s.policy_stats.items()):
                fams["policy_stat"].add_metric([*lv, stat], value)
            for path, value in _numeric_fields(s.policy):
                fams["policy"].add_metric([*lv, path], value)
        yield from fams.values()


def _numeric_fields(policy: policy_pb2.Policy) -> Iterator[tuple[str, float]]:
    """("shift.threshold", 256.0)-style pairs of every scalar field of the policy."""
    kind = policy_fields.kind_of(policy)
    if not kind:
        return
    msg = policy_fields.message_of(policy)
    for path, field in policy_fields.walk_fields(msg.DESCRIPTOR):
        if field.is_repeated or field.type in (
            FieldDescriptor.TYPE_MESSAGE,
            FieldDescriptor.TYPE_STRING,
            FieldDescriptor.TYPE_BYTES,
        ):
            continue
        target = msg
        *parents, leaf = path.split(".")
        for p in parents:
            target = getattr(target, p)
        yield f"{kind}.{path}", float(getattr(target, leaf))
