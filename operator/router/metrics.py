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
from gearshift.operator.router.metric_table import GROUP_METRICS, REQUEST_METRICS, MetricSpec
from gearshift.operator.router.trace_recorder import TraceRecorder
from gearshift.operator.router.traffic_window import TrafficWindow
from gearshift.v1 import policy_fields, policy_pb2, worker_pb2


class RouterMetrics:
    """Every metric of one router process, in its own registry (rows of metric_table.py)."""

    ttft: Histogram
    itl: Histogram
    tpot: Histogram
    e2e: Histogram
    queue: Histogram
    prompt_len: Histogram
    generation_len: Histogram
    prompt_tokens: Counter
    generation_tokens: Counter
    request_success: Counter
    rejected: Counter
    retries: Counter
    group_restarts: Counter
    tetris_chunks: Histogram
    tetris_chunk_sp: Histogram
    tetris_planned_prefill: Histogram
    tetris_improvement_rate: Histogram
    tetris_placements: Counter

    def __init__(self, model_name: str, groups: Callable[[], Iterable[Group]]) -> None:
        self.model_name = model_name
        # --record-trace: every finished request also goes to this file (trace_recorder.py).
        self.trace: TraceRecorder | None = None
        # The recent finished requests, for Admin.GetStatus's traffic (traffic_window.py).
        self.window = TrafficWindow()
        self.registry = CollectorRegistry(auto_describe=True)
        for spec in REQUEST_METRICS:
            setattr(self, spec.key, _instrument(spec, self.registry))
        self.registry.register(GroupCollector(model_name, groups))

    def observe_tetris_plan(self, plan: worker_pb2.TetrisPlan) -> None:
        """One request's Tetris plan as the router sent it."""
        name = self.model_name
        self.tetris_chunks.labels(name).observe(len(plan.chunks))
        for chunk in plan.chunks:
            self.tetris_chunk_sp.labels(name).observe(len(chunk.prefill_instances))
        self.tetris_planned_prefill.labels(name).observe(plan.planned_prefill_seconds)
        if plan.improvement_rate_source:
            source = worker_pb2.TetrisPlan.RateSource.Name(plan.improvement_rate_source).lower()
            self.tetris_improvement_rate.labels(name, source).observe(plan.improvement_rate)
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
        # Both callers measure e2e on the monotonic clock, from the request's arrival.
        arrival = time.monotonic() - e2e
        self.window.record(arrival, prompt_tokens, output_tokens)
        if self.trace is not None:
            self.trace.record(arrival, prompt_tokens, output_tokens, finish_reason)


class GroupCollector(Collector):
    """Per-group gauges and counters from each group's last GetStats answer."""

    def __init__(self, model_name: str, groups: Callable[[], Iterable[Group]]) -> None:
        self.model_name = model_name
        self.groups = groups

    def describe(self) -> Iterable[Metric]:
        return []  # dynamic label sets: let the registry collect instead

    def collect(self) -> Iterator[Metric]:
        fams = {spec.key: _family(spec) for spec in GROUP_METRICS}
        for g in self.groups():
            lv = [self.model_name, g.name]
            fams["serving"].add_metric(lv, 1.0 if g.serving else 0.0)
            fams["in_flight"].add_metric(lv, g.load.in_flight)
            fams["queued"].add_metric(lv, len(g.room))
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


def _instrument(spec: MetricSpec, registry: CollectorRegistry) -> Histogram | Counter:
    if spec.kind == "histogram":
        return Histogram(spec.name, spec.help, spec.labels, buckets=spec.buckets, registry=registry)
    assert spec.kind == "counter", spec
    return Counter(spec.name, spec.help, spec.labels, registry=registry)


def _family(spec: MetricSpec) -> GaugeMetricFamily | CounterMetricFamily:
    if spec.kind == "gauge":
        return GaugeMetricFamily(spec.name, spec.help, labels=spec.labels)
    assert spec.kind == "counter", spec
    return CounterMetricFamily(spec.name, spec.help, labels=spec.labels)


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
