from gearshift.v1 import common_pb2 as _common_pb2
from gearshift.v1 import policy_pb2 as _policy_pb2
from gearshift.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("model", "prompt", "prompt_token_ids", "sampling", "stream", "request_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    stream: bool
    request_id: str
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stream: _Optional[bool] = ..., request_id: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "logprobs", "finish_reason", "usage", "group", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    group: str
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., group: _Optional[str] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class AdminApplyPolicyRequest(_message.Message):
    __slots__ = ("group", "policy")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    group: str
    policy: _policy_pb2.Policy
    def __init__(self, group: _Optional[str] = ..., policy: _Optional[_Union[_policy_pb2.Policy, _Mapping]] = ...) -> None: ...

class GroupApplyResult(_message.Message):
    __slots__ = ("group", "applied", "message", "policy")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    group: str
    applied: bool
    message: str
    policy: _policy_pb2.Policy
    def __init__(self, group: _Optional[str] = ..., applied: _Optional[bool] = ..., message: _Optional[str] = ..., policy: _Optional[_Union[_policy_pb2.Policy, _Mapping]] = ...) -> None: ...

class AdminApplyPolicyResponse(_message.Message):
    __slots__ = ("applied", "results")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    applied: bool
    results: _containers.RepeatedCompositeFieldContainer[GroupApplyResult]
    def __init__(self, applied: _Optional[bool] = ..., results: _Optional[_Iterable[_Union[GroupApplyResult, _Mapping]]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GroupStatus(_message.Message):
    __slots__ = ("name", "address", "serving", "gear", "policy", "stats", "draining", "message")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    GEAR_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    serving: bool
    gear: str
    policy: _policy_pb2.Policy
    stats: _worker_pb2.WorkerStats
    draining: bool
    message: str
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., serving: _Optional[bool] = ..., gear: _Optional[str] = ..., policy: _Optional[_Union[_policy_pb2.Policy, _Mapping]] = ..., stats: _Optional[_Union[_worker_pb2.WorkerStats, _Mapping]] = ..., draining: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class RouterStatus(_message.Message):
    __slots__ = ("groups", "model", "traffic")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[GroupStatus]
    model: str
    traffic: ObservedTraffic
    def __init__(self, groups: _Optional[_Iterable[_Union[GroupStatus, _Mapping]]] = ..., model: _Optional[str] = ..., traffic: _Optional[_Union[ObservedTraffic, _Mapping]] = ...) -> None: ...

class ObservedTraffic(_message.Message):
    __slots__ = ("requests", "window_seconds", "rate", "burstiness", "prompt_tokens", "output_tokens", "max_requests", "max_age_seconds")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RATE_FIELD_NUMBER: _ClassVar[int]
    BURSTINESS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    requests: int
    window_seconds: float
    rate: float
    burstiness: float
    prompt_tokens: LengthSummary
    output_tokens: LengthSummary
    max_requests: int
    max_age_seconds: float
    def __init__(self, requests: _Optional[int] = ..., window_seconds: _Optional[float] = ..., rate: _Optional[float] = ..., burstiness: _Optional[float] = ..., prompt_tokens: _Optional[_Union[LengthSummary, _Mapping]] = ..., output_tokens: _Optional[_Union[LengthSummary, _Mapping]] = ..., max_requests: _Optional[int] = ..., max_age_seconds: _Optional[float] = ...) -> None: ...

class LengthSummary(_message.Message):
    __slots__ = ("median", "p90", "min", "max")
    MEDIAN_FIELD_NUMBER: _ClassVar[int]
    P90_FIELD_NUMBER: _ClassVar[int]
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    median: float
    p90: float
    min: int
    max: int
    def __init__(self, median: _Optional[float] = ..., p90: _Optional[float] = ..., min: _Optional[int] = ..., max: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("group", "resume")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    group: str
    resume: bool
    def __init__(self, group: _Optional[str] = ..., resume: _Optional[bool] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("in_flight",)
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    in_flight: int
    def __init__(self, in_flight: _Optional[int] = ...) -> None: ...
