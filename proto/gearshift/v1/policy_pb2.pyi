from google.protobuf import any_pb2 as _any_pb2
from gearshift.v1 import options_pb2 as _options_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Policy(_message.Message):
    __slots__ = ("static", "shift", "seesaw", "sidp", "tetris", "auto", "plugin")
    STATIC_FIELD_NUMBER: _ClassVar[int]
    SHIFT_FIELD_NUMBER: _ClassVar[int]
    SEESAW_FIELD_NUMBER: _ClassVar[int]
    SIDP_FIELD_NUMBER: _ClassVar[int]
    TETRIS_FIELD_NUMBER: _ClassVar[int]
    AUTO_FIELD_NUMBER: _ClassVar[int]
    PLUGIN_FIELD_NUMBER: _ClassVar[int]
    static: StaticPolicy
    shift: ShiftPolicy
    seesaw: SeesawPolicy
    sidp: SidpPolicy
    tetris: TetrisPolicy
    auto: AutoPolicy
    plugin: _any_pb2.Any
    def __init__(self, static: _Optional[_Union[StaticPolicy, _Mapping]] = ..., shift: _Optional[_Union[ShiftPolicy, _Mapping]] = ..., seesaw: _Optional[_Union[SeesawPolicy, _Mapping]] = ..., sidp: _Optional[_Union[SidpPolicy, _Mapping]] = ..., tetris: _Optional[_Union[TetrisPolicy, _Mapping]] = ..., auto: _Optional[_Union[AutoPolicy, _Mapping]] = ..., plugin: _Optional[_Union[_any_pb2.Any, _Mapping]] = ...) -> None: ...

class StaticPolicy(_message.Message):
    __slots__ = ("tp", "pp", "sp", "dp")
    TP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    SP_FIELD_NUMBER: _ClassVar[int]
    DP_FIELD_NUMBER: _ClassVar[int]
    tp: int
    pp: int
    sp: int
    dp: int
    def __init__(self, tp: _Optional[int] = ..., pp: _Optional[int] = ..., sp: _Optional[int] = ..., dp: _Optional[int] = ...) -> None: ...

class ShiftPolicy(_message.Message):
    __slots__ = ("sp", "tp", "threshold")
    SP_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    sp: int
    tp: int
    threshold: int
    def __init__(self, sp: _Optional[int] = ..., tp: _Optional[int] = ..., threshold: _Optional[int] = ...) -> None: ...

class GearLayout(_message.Message):
    __slots__ = ("tp", "pp")
    TP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    tp: int
    pp: int
    def __init__(self, tp: _Optional[int] = ..., pp: _Optional[int] = ...) -> None: ...

class SeesawPolicy(_message.Message):
    __slots__ = ("prefill", "decode", "host_kv_capacity_bytes", "host_kv_capacity_fraction", "async_swap", "pinned_staging_bytes", "prefetch_max_sequences", "switch_to_decode_at_host_usage", "switch_to_prefill_at_host_usage")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    HOST_KV_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_KV_CAPACITY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    ASYNC_SWAP_FIELD_NUMBER: _ClassVar[int]
    PINNED_STAGING_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_MAX_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SWITCH_TO_DECODE_AT_HOST_USAGE_FIELD_NUMBER: _ClassVar[int]
    SWITCH_TO_PREFILL_AT_HOST_USAGE_FIELD_NUMBER: _ClassVar[int]
    prefill: GearLayout
    decode: GearLayout
    host_kv_capacity_bytes: int
    host_kv_capacity_fraction: float
    async_swap: bool
    pinned_staging_bytes: int
    prefetch_max_sequences: int
    switch_to_decode_at_host_usage: float
    switch_to_prefill_at_host_usage: float
    def __init__(self, prefill: _Optional[_Union[GearLayout, _Mapping]] = ..., decode: _Optional[_Union[GearLayout, _Mapping]] = ..., host_kv_capacity_bytes: _Optional[int] = ..., host_kv_capacity_fraction: _Optional[float] = ..., async_swap: _Optional[bool] = ..., pinned_staging_bytes: _Optional[int] = ..., prefetch_max_sequences: _Optional[int] = ..., switch_to_decode_at_host_usage: _Optional[float] = ..., switch_to_prefill_at_host_usage: _Optional[float] = ...) -> None: ...

class SidpPolicy(_message.Message):
    __slots__ = ("dp", "tp", "mode", "was_cache_slots", "cas_slots", "prefetch_depth", "peak_shifting", "dummy_skipping", "cas_enter_batch_size", "was_enter_batch_size", "window_steps", "min_dwell_steps", "cas_overlap")
    class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        MODE_UNSPECIFIED: _ClassVar[SidpPolicy.Mode]
        AUTO: _ClassVar[SidpPolicy.Mode]
        WAS: _ClassVar[SidpPolicy.Mode]
        CAS: _ClassVar[SidpPolicy.Mode]
    MODE_UNSPECIFIED: SidpPolicy.Mode
    AUTO: SidpPolicy.Mode
    WAS: SidpPolicy.Mode
    CAS: SidpPolicy.Mode
    DP_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    WAS_CACHE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    CAS_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_DEPTH_FIELD_NUMBER: _ClassVar[int]
    PEAK_SHIFTING_FIELD_NUMBER: _ClassVar[int]
    DUMMY_SKIPPING_FIELD_NUMBER: _ClassVar[int]
    CAS_ENTER_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    WAS_ENTER_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_STEPS_FIELD_NUMBER: _ClassVar[int]
    MIN_DWELL_STEPS_FIELD_NUMBER: _ClassVar[int]
    CAS_OVERLAP_FIELD_NUMBER: _ClassVar[int]
    dp: int
    tp: int
    mode: SidpPolicy.Mode
    was_cache_slots: int
    cas_slots: int
    prefetch_depth: int
    peak_shifting: bool
    dummy_skipping: bool
    cas_enter_batch_size: int
    was_enter_batch_size: int
    window_steps: int
    min_dwell_steps: int
    cas_overlap: bool
    def __init__(self, dp: _Optional[int] = ..., tp: _Optional[int] = ..., mode: _Optional[_Union[SidpPolicy.Mode, str]] = ..., was_cache_slots: _Optional[int] = ..., cas_slots: _Optional[int] = ..., prefetch_depth: _Optional[int] = ..., peak_shifting: _Optional[bool] = ..., dummy_skipping: _Optional[bool] = ..., cas_enter_batch_size: _Optional[int] = ..., was_enter_batch_size: _Optional[int] = ..., window_steps: _Optional[int] = ..., min_dwell_steps: _Optional[int] = ..., cas_overlap: _Optional[bool] = ...) -> None: ...

class TetrisPolicy(_message.Message):
    __slots__ = ("prefill_instances", "prefill_tp", "decode_instances", "decode_tp", "chunk_granularity", "max_sp", "power_of_two_sp", "max_chunks", "improvement_rate", "improvement_rate_table", "rate_window_seconds", "decode_placement", "transfer_backends", "transfer_buffer_bytes", "layerwise_transfer", "latency_models", "auto_profile_tokens")
    class DecodePlacement(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        PLACEMENT_UNSPECIFIED: _ClassVar[TetrisPolicy.DecodePlacement]
        FREENESS: _ClassVar[TetrisPolicy.DecodePlacement]
        LEAST_LOADED: _ClassVar[TetrisPolicy.DecodePlacement]
        ROUND_ROBIN: _ClassVar[TetrisPolicy.DecodePlacement]
    PLACEMENT_UNSPECIFIED: TetrisPolicy.DecodePlacement
    FREENESS: TetrisPolicy.DecodePlacement
    LEAST_LOADED: TetrisPolicy.DecodePlacement
    ROUND_ROBIN: TetrisPolicy.DecodePlacement
    class LatencyModel(_message.Message):
        __slots__ = ("sp", "a", "b", "c", "d")
        SP_FIELD_NUMBER: _ClassVar[int]
        A_FIELD_NUMBER: _ClassVar[int]
        B_FIELD_NUMBER: _ClassVar[int]
        C_FIELD_NUMBER: _ClassVar[int]
        D_FIELD_NUMBER: _ClassVar[int]
        sp: int
        a: float
        b: float
        c: float
        d: float
        def __init__(self, sp: _Optional[int] = ..., a: _Optional[float] = ..., b: _Optional[float] = ..., c: _Optional[float] = ..., d: _Optional[float] = ...) -> None: ...
    class ImprovementRateStep(_message.Message):
        __slots__ = ("request_rate", "improvement_rate")
        REQUEST_RATE_FIELD_NUMBER: _ClassVar[int]
        IMPROVEMENT_RATE_FIELD_NUMBER: _ClassVar[int]
        request_rate: float
        improvement_rate: float
        def __init__(self, request_rate: _Optional[float] = ..., improvement_rate: _Optional[float] = ...) -> None: ...
    PREFILL_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TP_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    DECODE_TP_FIELD_NUMBER: _ClassVar[int]
    CHUNK_GRANULARITY_FIELD_NUMBER: _ClassVar[int]
    MAX_SP_FIELD_NUMBER: _ClassVar[int]
    POWER_OF_TWO_SP_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    IMPROVEMENT_RATE_FIELD_NUMBER: _ClassVar[int]
    IMPROVEMENT_RATE_TABLE_FIELD_NUMBER: _ClassVar[int]
    RATE_WINDOW_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BACKENDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BUFFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYERWISE_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MODELS_FIELD_NUMBER: _ClassVar[int]
    AUTO_PROFILE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prefill_instances: int
    prefill_tp: int
    decode_instances: int
    decode_tp: int
    chunk_granularity: int
    max_sp: int
    power_of_two_sp: bool
    max_chunks: int
    improvement_rate: float
    improvement_rate_table: _containers.RepeatedCompositeFieldContainer[TetrisPolicy.ImprovementRateStep]
    rate_window_seconds: int
    decode_placement: TetrisPolicy.DecodePlacement
    transfer_backends: int
    transfer_buffer_bytes: int
    layerwise_transfer: bool
    latency_models: _containers.RepeatedCompositeFieldContainer[TetrisPolicy.LatencyModel]
    auto_profile_tokens: int
    def __init__(self, prefill_instances: _Optional[int] = ..., prefill_tp: _Optional[int] = ..., decode_instances: _Optional[int] = ..., decode_tp: _Optional[int] = ..., chunk_granularity: _Optional[int] = ..., max_sp: _Optional[int] = ..., power_of_two_sp: _Optional[bool] = ..., max_chunks: _Optional[int] = ..., improvement_rate: _Optional[float] = ..., improvement_rate_table: _Optional[_Iterable[_Union[TetrisPolicy.ImprovementRateStep, _Mapping]]] = ..., rate_window_seconds: _Optional[int] = ..., decode_placement: _Optional[_Union[TetrisPolicy.DecodePlacement, str]] = ..., transfer_backends: _Optional[int] = ..., transfer_buffer_bytes: _Optional[int] = ..., layerwise_transfer: _Optional[bool] = ..., latency_models: _Optional[_Iterable[_Union[TetrisPolicy.LatencyModel, _Mapping]]] = ..., auto_profile_tokens: _Optional[int] = ...) -> None: ...

class AutoPolicy(_message.Message):
    __slots__ = ("model", "gpu", "traffic", "goodput", "policies", "requests", "apply", "margin", "cooldown_seconds", "profile", "calibrate")
    class Apply(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        APPLY_UNSPECIFIED: _ClassVar[AutoPolicy.Apply]
        Recommend: _ClassVar[AutoPolicy.Apply]
        Auto: _ClassVar[AutoPolicy.Apply]
    APPLY_UNSPECIFIED: AutoPolicy.Apply
    Recommend: AutoPolicy.Apply
    Auto: AutoPolicy.Apply
    MODEL_FIELD_NUMBER: _ClassVar[int]
    GPU_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_FIELD_NUMBER: _ClassVar[int]
    POLICIES_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    APPLY_FIELD_NUMBER: _ClassVar[int]
    MARGIN_FIELD_NUMBER: _ClassVar[int]
    COOLDOWN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    CALIBRATE_FIELD_NUMBER: _ClassVar[int]
    model: AutoModel
    gpu: str
    traffic: AutoTraffic
    goodput: str
    policies: _containers.RepeatedScalarFieldContainer[str]
    requests: int
    apply: AutoPolicy.Apply
    margin: float
    cooldown_seconds: int
    profile: str
    calibrate: bool
    def __init__(self, model: _Optional[_Union[AutoModel, _Mapping]] = ..., gpu: _Optional[str] = ..., traffic: _Optional[_Union[AutoTraffic, _Mapping]] = ..., goodput: _Optional[str] = ..., policies: _Optional[_Iterable[str]] = ..., requests: _Optional[int] = ..., apply: _Optional[_Union[AutoPolicy.Apply, str]] = ..., margin: _Optional[float] = ..., cooldown_seconds: _Optional[int] = ..., profile: _Optional[str] = ..., calibrate: _Optional[bool] = ...) -> None: ...

class AutoModel(_message.Message):
    __slots__ = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size", "torch_dtype", "head_dim")
    NUM_HIDDEN_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_ATTENTION_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KEY_VALUE_HEADS_FIELD_NUMBER: _ClassVar[int]
    INTERMEDIATE_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TORCH_DTYPE_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    torch_dtype: str
    head_dim: int
    def __init__(self, num_hidden_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_attention_heads: _Optional[int] = ..., num_key_value_heads: _Optional[int] = ..., intermediate_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., torch_dtype: _Optional[str] = ..., head_dim: _Optional[int] = ...) -> None: ...

class AutoTraffic(_message.Message):
    __slots__ = ("rate", "burstiness", "prompt", "output", "source")
    class Source(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        SOURCE_UNSPECIFIED: _ClassVar[AutoTraffic.Source]
        Declared: _ClassVar[AutoTraffic.Source]
        Observed: _ClassVar[AutoTraffic.Source]
    SOURCE_UNSPECIFIED: AutoTraffic.Source
    Declared: AutoTraffic.Source
    Observed: AutoTraffic.Source
    RATE_FIELD_NUMBER: _ClassVar[int]
    BURSTINESS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    rate: float
    burstiness: float
    prompt: AutoLengths
    output: AutoLengths
    source: AutoTraffic.Source
    def __init__(self, rate: _Optional[float] = ..., burstiness: _Optional[float] = ..., prompt: _Optional[_Union[AutoLengths, _Mapping]] = ..., output: _Optional[_Union[AutoLengths, _Mapping]] = ..., source: _Optional[_Union[AutoTraffic.Source, str]] = ...) -> None: ...

class AutoLengths(_message.Message):
    __slots__ = ("preset", "fixed")
    PRESET_FIELD_NUMBER: _ClassVar[int]
    FIXED_FIELD_NUMBER: _ClassVar[int]
    preset: str
    fixed: int
    def __init__(self, preset: _Optional[str] = ..., fixed: _Optional[int] = ...) -> None: ...
