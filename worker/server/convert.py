"""Proto ↔ engine: sampling parameters, outputs, stats and the active policy."""

from __future__ import annotations

import time
from dataclasses import dataclass

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from gearshift.v1 import common_pb2, policy_fields, policy_pb2, worker_pb2
from gearshift.worker.engine.contract import LiveValue
from gearshift.worker.engine.llm_engine import EngineStats
from gearshift.worker.engine.outputs import RequestMetrics, RequestOutput
from gearshift.worker.engine.sequence import FinishReason
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.policies import live_values
from gearshift.worker.sampling.logprobs import TokenLogprobs
from gearshift.worker.sampling.params import SamplingParams
from gearshift.worker.structured.grammar import spec_from_proto

FINISH_REASONS = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}


def sampling_params(p: common_pb2.SamplingParams) -> SamplingParams:
    """Engine parameters from the proto (raises InvalidSamplingParams naming the field).

    Stop strings are the router's job (it detokenises); the worker checks stop token ids only.
    """
    return SamplingParams(
        max_tokens=p.max_tokens if p.HasField("max_tokens") else None,
        min_tokens=p.min_tokens,
        temperature=p.temperature if p.HasField("temperature") else 1.0,
        top_p=p.top_p if p.HasField("top_p") else 1.0,
        top_k=p.top_k if p.top_k > 0 else -1,
        min_p=p.min_p,
        seed=p.seed if p.HasField("seed") else None,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else 1.0,
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        skip_special_tokens=p.skip_special_tokens if p.HasField("skip_special_tokens") else True,
        logit_bias=dict(p.logit_bias),
        allowed_token_ids=tuple(p.allowed_token_ids),
        bad_words=tuple(tuple(w.token_ids) for w in p.bad_words),
        structured=spec_from_proto(p.structured) if p.HasField("structured") else None,
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        cache_salt=p.cache_salt,
    )


@dataclass(frozen=True)
class Clock:
    """Maps the engine's monotonic timestamps to Unix time (RequestTiming is in Unix seconds)."""

    offset: float

    @staticmethod
    def now() -> Clock:
        return Clock(time.time() - time.monotonic())

    def unix(self, monotonic: float | None) -> float:
        return 0.0 if monotonic is None else monotonic + self.offset


def timing(metrics: RequestMetrics, clock: Clock) -> worker_pb2.RequestTiming:
    return worker_pb2.RequestTiming(
        queued_time=clock.unix(metrics.arrival_time),
        scheduled_time=clock.unix(metrics.first_scheduled_time),
        first_token_time=clock.unix(metrics.first_token_time),
        finished_time=clock.unix(metrics.finished_time),
    )


def token_logprob(lp: TokenLogprobs) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        rank=lp.rank,
        top_logprobs=[common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
    )


def merge_outputs(
    outputs: list[RequestOutput], clock: Clock, first: bool
) -> worker_pb2.WorkerGenerateResponse:
    """One response from the outputs queued since the last one (usually exactly one)."""
    last = outputs[-1]
    response = worker_pb2.WorkerGenerateResponse(
        request_id=last.request_id,
        usage=common_pb2.Usage(
            prompt_tokens=last.num_prompt_tokens,
            completion_tokens=last.num_output_tokens,
            cached_prompt_tokens=last.num_cached_tokens,
        ),
    )
    for out in outputs:
        response.token_ids.extend(out.new_token_ids)
        if out.new_logprobs:
            response.logprobs.extend(token_logprob(lp) for lp in out.new_logprobs)
        if out.prompt_logprobs:
            response.prompt_logprobs.extend(token_logprob(lp) for lp in out.prompt_logprobs)
    if last.finished and last.finish_reason is not None:
        response.finish_reason = FINISH_REASONS[last.finish_reason]
    if first or last.finished:
        response.timing.CopyFrom(timing(last.metrics, clock))
    return response


# ---- policy --------------------------------------------------------------------------------


def live_update(active: policy_pb2.Policy, requested: policy_pb2.Policy) -> dict[str, LiveValue]:
    """The `update_live` payload of an ApplyPolicy request (ApplyPolicyRequest semantics).

    Raises InvalidRequestError naming the field when the request changes the kind or a
    non-live field, or sets a value outside the field's bounds. Live parameter names are the
    proto field names below the kind ("threshold" for shift.threshold).
    """
    kind = policy_fields.kind_of(requested)
    active_kind = policy_fields.kind_of(active)
    if kind != active_kind:
        raise InvalidRequestError(
            "policy", f"policy kind {kind or '(none)'!r} differs from the active {active_kind!r}"
        )
    msg = policy_fields.copy_of(active)
    given = policy_fields.message_of(requested)
    for f in given.DESCRIPTOR.fields:
        if f.is_repeated and len(getattr(given, f.name)):
            msg.ClearField(f.name)  # a repeated field given replaces the active one's elements
    msg.MergeFrom(given)
    merged = policy_fields.policy_of(kind, msg)
    not_live = policy_fields.non_live_changes(active, merged)
    if not_live:
        names = ", ".join(not_live)
        raise InvalidRequestError(
            not_live[0], f"{names} cannot change while the group runs (not live; roll the group)"
        )
    values: dict[str, LiveValue] = {}
    for path in policy_fields.changed_fields(active, merged):
        _, name = path.split(".", 1)
        field = _field(msg.DESCRIPTOR, name)
        value = getattr(msg, name) if "." not in name else None
        if value is not None and field.is_repeated:
            values[name] = live_values.items_of(field, value)  # replaces every element
            continue
        if value is None or field.type == FieldDescriptor.TYPE_MESSAGE:
            raise InvalidRequestError(path, f"{path} cannot be changed by this worker")
        lo, hi = policy_fields.bounds(field)
        if isinstance(value, (int, float)) and (
            (lo is not None and value < lo) or (hi is not None and value > hi)
        ):
            raise InvalidRequestError(path, f"{path} must be in [{lo}, {hi}], got {value}")
        if field.type == FieldDescriptor.TYPE_ENUM:
            value = field.enum_type.values_by_number[int(value)].name
        values[name] = value
    return values


def _field(desc: Descriptor, name: str) -> FieldDescriptor:
    for part in name.split(".")[:-1]:
        desc = desc.fields_by_name[part].message_type
    return desc.fields_by_name[name.split(".")[-1]]


def worker_stats(
    stats: EngineStats,
    *,
    model: str,
    max_model_len: int,
    policy: policy_pb2.Policy,
    ranks: int,
    revision: str,
) -> worker_pb2.WorkerStats:
    out = worker_pb2.WorkerStats(
        model=model,
        max_model_len=max_model_len,
        running=stats.num_running,
        waiting=stats.num_waiting,
        kv_blocks_total=stats.kv_blocks_total,
        kv_blocks_used=stats.kv_blocks_used,
        kv_usage=stats.kv_usage,
        outstanding_tokens=stats.outstanding_tokens,
        gear=stats.gear,
        policy=policy,
        gear_switches=stats.gear_switches,
        preemptions=stats.num_preemptions,
        ranks=ranks,
        revision=revision,
    )
    for name, steps in stats.gear_steps.items():
        out.gears.add(name=name, steps=steps, tokens=stats.gear_tokens.get(name, 0))
    out.policy_stats.update(stats.policy_stats)
    for index, load in enumerate(stats.replicas):
        out.replicas.add(
            index=index,
            running=load.running,
            waiting=load.waiting,
            outstanding_tokens=load.outstanding_tokens,
        )
    for inst in stats.instances:
        out.instances.add(
            role=worker_pb2.InstanceStats.Role.Value(inst.role.upper()),
            index=inst.index,
            queued_seconds=inst.queued_seconds,
            kv_slots_free=inst.kv_slots_free,
            kv_slots_reserved=inst.kv_slots_reserved,
            batch_size=inst.batch_size,
            node=inst.node,
            kv_slots_total=inst.kv_slots_total,
        )
    # The two figures WorkerStats names on its own (a policy with a host KV tier, re-sharding).
    out.host_kv_usage = stats.policy_stats.get("host_kv_usage", 0.0)
    out.reshard_seconds = stats.policy_stats.get("reshard_seconds", 0.0)
    return out
