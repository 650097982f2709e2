from gearshift.v1 import common_pb2 as _common_pb2
from gearshift.v1 import policy_pb2 as _policy_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProfileTetrisRequest(_message.Message):
    __slots__ = ("sp_sizes", "histories", "lengths", "repeats")
    SP_SIZES_FIELD_NUMBER: _ClassVar[int]
    HISTORIES_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    REPEATS_FIELD_NUMBER: _ClassVar[int]
    sp_sizes: _containers.RepeatedScalarFieldContainer[int]
    histories: _containers.RepeatedScalarFieldContainer[int]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    repeats: int
    def __init__(self, sp_sizes: _Optional[_Iterable[int]] = ..., histories: _Optional[_Iterable[int]] = ..., lengths: _Optional[_Iterable[int]] = ..., repeats: _Optional[int] = ...) -> None: ...

class TetrisProfileSample(_message.Message):
    __slots__ = ("sp", "history", "length", "seconds")
    SP_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    sp: int
    history: int
    length: int
    seconds: float
    def __init__(self, sp: _Optional[int] = ..., history: _Optional[int] = ..., length: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class ProfileTetrisResponse(_message.Message):
    __slots__ = ("samples",)
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[TetrisProfileSample]
    def __init__(self, samples: _Optional[_Iterable[_Union[TetrisProfileSample, _Mapping]]] = ...) -> None: ...

class WorkerGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "tetris_plan", "replica")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TETRIS_PLAN_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    tetris_plan: TetrisPlan
    replica: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., tetris_plan: _Optional[_Union[TetrisPlan, _Mapping]] = ..., replica: _Optional[int] = ...) -> None: ...

class TetrisPlan(_message.Message):
    __slots__ = ("chunks", "decode_instance", "planned_prefill_seconds", "improvement_rate", "improvement_rate_source")
    class RateSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        RATE_SOURCE_UNSPECIFIED: _ClassVar[TetrisPlan.RateSource]
        POLICY_CONSTANT: _ClassVar[TetrisPlan.RateSource]
        POLICY_TABLE: _ClassVar[TetrisPlan.RateSource]
        PROFILED: _ClassVar[TetrisPlan.RateSource]
        DEFAULT: _ClassVar[TetrisPlan.RateSource]
    RATE_SOURCE_UNSPECIFIED: TetrisPlan.RateSource
    POLICY_CONSTANT: TetrisPlan.RateSource
    POLICY_TABLE: TetrisPlan.RateSource
    PROFILED: TetrisPlan.RateSource
    DEFAULT: TetrisPlan.RateSource
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    PLANNED_PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IMPROVEMENT_RATE_FIELD_NUMBER: _ClassVar[int]
    IMPROVEMENT_RATE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[TetrisChunk]
    decode_instance: int
    planned_prefill_seconds: float
    improvement_rate: float
    improvement_rate_source: TetrisPlan.RateSource
    def __init__(self, chunks: _Optional[_Iterable[_Union[TetrisChunk, _Mapping]]] = ..., decode_instance: _Optional[int] = ..., planned_prefill_seconds: _Optional[float] = ..., improvement_rate: _Optional[float] = ..., improvement_rate_source: _Optional[_Union[TetrisPlan.RateSource, str]] = ...) -> None: ...

class TetrisChunk(_message.Message):
    __slots__ = ("num_tokens", "prefill_instances")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    prefill_instances: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_tokens: _Optional[int] = ..., prefill_instances: _Optional[_Iterable[int]] = ...) -> None: ...

class RequestTiming(_message.Message):
    __slots__ = ("queued_time", "scheduled_time", "first_token_time", "finished_time")
    QUEUED_TIME_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_TIME_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_TIME_FIELD_NUMBER: _ClassVar[int]
    FINISHED_TIME_FIELD_NUMBER: _ClassVar[int]
    queued_time: float
    scheduled_time: float
    first_token_time: float
    finished_time: float
    def __init__(self, queued_time: _Optional[float] = ..., scheduled_time: _Optional[float] = ..., first_token_time: _Optional[float] = ..., finished_time: _Optional[float] = ...) -> None: ...

class WorkerGenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "logprobs", "finish_reason", "usage", "timing", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    timing: RequestTiming
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., timing: _Optional[_Union[RequestTiming, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GearStats(_message.Message):
    __slots__ = ("name", "steps", "tokens", "busy_seconds")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    steps: int
    tokens: int
    busy_seconds: float
    def __init__(self, name: _Optional[str] = ..., steps: _Optional[int] = ..., tokens: _Optional[int] = ..., busy_seconds: _Optional[float] = ...) -> None: ...

class InstanceStats(_message.Message):
    __slots__ = ("role", "index", "queued_seconds", "kv_slots_free", "kv_slots_reserved", "batch_size", "node", "kv_slots_total")
    class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        ROLE_UNSPECIFIED: _ClassVar[InstanceStats.Role]
        PREFILL: _ClassVar[InstanceStats.Role]
        DECODE: _ClassVar[InstanceStats.Role]
    ROLE_UNSPECIFIED: InstanceStats.Role
    PREFILL: InstanceStats.Role
    DECODE: InstanceStats.Role
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    QUEUED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_SLOTS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_SLOTS_RESERVED_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    KV_SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    role: InstanceStats.Role
    index: int
    queued_seconds: float
    kv_slots_free: int
    kv_slots_reserved: int
    batch_size: int
    node: int
    kv_slots_total: int
    def __init__(self, role: _Optional[_Union[InstanceStats.Role, str]] = ..., index: _Optional[int] = ..., queued_seconds: _Optional[float] = ..., kv_slots_free: _Optional[int] = ..., kv_slots_reserved: _Optional[int] = ..., batch_size: _Optional[int] = ..., node: _Optional[int] = ..., kv_slots_total: _Optional[int] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("model", "max_model_len", "running", "waiting", "kv_blocks_total", "kv_blocks_used", "kv_usage", "outstanding_tokens", "gear", "policy", "gears", "gear_switches", "host_kv_usage", "reshard_seconds", "fetched_weight_bytes", "preemptions", "ranks", "instances", "revision", "policy_stats", "replicas", "tetris_models")
    class PolicyStatsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GEAR_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    GEARS_FIELD_NUMBER: _ClassVar[int]
    GEAR_SWITCHES_FIELD_NUMBER: _ClassVar[int]
    HOST_KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    RESHARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FETCHED_WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    POLICY_STATS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    TETRIS_MODELS_FIELD_NUMBER: _ClassVar[int]
    model: str
    max_model_len: int
    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_usage: float
    outstanding_tokens: int
    gear: str
    policy: _policy_pb2.Policy
    gears: _containers.RepeatedCompositeFieldContainer[GearStats]
    gear_switches: int
    host_kv_usage: float
    reshard_seconds: float
    fetched_weight_bytes: int
    preemptions: int
    ranks: int
    instances: _containers.RepeatedCompositeFieldContainer[InstanceStats]
    revision: str
    policy_stats: _containers.ScalarMap[str, float]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStats]
    tetris_models: TetrisModelStatus
    def __init__(self, model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_usage: _Optional[float] = ..., outstanding_tokens: _Optional[int] = ..., gear: _Optional[str] = ..., policy: _Optional[_Union[_policy_pb2.Policy, _Mapping]] = ..., gears: _Optional[_Iterable[_Union[GearStats, _Mapping]]] = ..., gear_switches: _Optional[int] = ..., host_kv_usage: _Optional[float] = ..., reshard_seconds: _Optional[float] = ..., fetched_weight_bytes: _Optional[int] = ..., preemptions: _Optional[int] = ..., ranks: _Optional[int] = ..., instances: _Optional[_Iterable[_Union[InstanceStats, _Mapping]]] = ..., revision: _Optional[str] = ..., policy_stats: _Optional[_Mapping[str, float]] = ..., replicas: _Optional[_Iterable[_Union[ReplicaStats, _Mapping]]] = ..., tetris_models: _Optional[_Union[TetrisModelStatus, _Mapping]] = ...) -> None: ...

class TetrisModelStatus(_message.Message):
    __slots__ = ("source", "models", "fit_rms_error", "samples", "profile_seconds", "message")
    class Source(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        SOURCE_UNSPECIFIED: _ClassVar[TetrisModelStatus.Source]
        POLICY: _ClassVar[TetrisModelStatus.Source]
        AUTO_FITTED: _ClassVar[TetrisModelStatus.Source]
        NONE: _ClassVar[TetrisModelStatus.Source]
    SOURCE_UNSPECIFIED: TetrisModelStatus.Source
    POLICY: TetrisModelStatus.Source
    AUTO_FITTED: TetrisModelStatus.Source
    NONE: TetrisModelStatus.Source
    class FitRmsErrorEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    FIT_RMS_ERROR_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PROFILE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    source: TetrisModelStatus.Source
    models: _containers.RepeatedCompositeFieldContainer[_policy_pb2.TetrisPolicy.LatencyModel]
    fit_rms_error: _containers.ScalarMap[int, float]
    samples: int
    profile_seconds: float
    message: str
    def __init__(self, source: _Optional[_Union[TetrisModelStatus.Source, str]] = ..., models: _Optional[_Iterable[_Union[_policy_pb2.TetrisPolicy.LatencyModel, _Mapping]]] = ..., fit_rms_error: _Optional[_Mapping[int, float]] = ..., samples: _Optional[int] = ..., profile_seconds: _Optional[float] = ..., message: _Optional[str] = ...) -> None: ...

class ReplicaStats(_message.Message):
    __slots__ = ("index", "running", "waiting", "outstanding_tokens")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    index: int
    running: int
    waiting: int
    outstanding_tokens: int
    def __init__(self, index: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., outstanding_tokens: _Optional[int] = ...) -> None: ...

class ApplyPolicyRequest(_message.Message):
    __slots__ = ("policy",)
    POLICY_FIELD_NUMBER: _ClassVar[int]
    policy: _policy_pb2.Policy
    def __init__(self, policy: _Optional[_Union[_policy_pb2.Policy, _Mapping]] = ...) -> None: ...

class ApplyPolicyResponse(_message.Message):
    __slots__ = ("applied", "message", "policy")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    applied: bool
    message: str
    policy: _policy_pb2.Policy
    def __init__(self, applied: _Optional[bool] = ..., message: _Optional[str] = ..., policy: _Optional[_Union[_policy_pb2.Policy, _Mapping]] = ...) -> None: ...
