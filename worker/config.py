"""Engine configuration: what the leader needs to build a model, its KV cache and its scheduler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gearshift.worker.attention.triton import mode as triton_mode
from gearshift.worker.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

# This module imports no torch: the router and `gearshift serve` validate an EngineConfig in
# processes that never run a model, and importing torch costs them over 2 s of CPU each.
# The dtype names map to torch's attribute names, resolved where a rank needs the dtype.
_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}
# Weight packings (kernels.cpu_features chooses among them; kept here so no torch is needed).
PACKINGS = ("auto", "plain", "onednn")

DEFAULT_CPU_KV_BYTES = 4 << 30
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
FUSED_CHOICES = ("auto", "on", "off")


@dataclass(frozen=True)
class EngineConfig:
    """Knobs with vLLM's names and meanings where one exists."""

    model: str
    dtype: str = "auto"
    device: str = "cpu"
    # Tokens per KV block. Default: 64 on CPU, where attention streams each (block, head) run
    # and longer runs read faster (vLLM's CPU backend uses 128); 16 on GPU. 0: that default.
    block_size: int = 0
    # CPU: bytes for KV blocks (default 4 GiB, capped at what max_num_seqs full-length sequences
    # can use). GPU: fraction of free device memory after the weights.
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    show_progress: bool = False
    detokenize: bool = True
    skip_tokenizer_init: bool = False  # token ids in and out only (models without a tokenizer)
    num_threads: int | None = None
    # CPU: torch threads for steps of at least PREFILL_THREADS_MIN_TOKENS tokens (prefill-heavy,
    # compute-bound steps while the serving processes beside the engine wait). None: num_threads.
    prefill_threads: int | None = None
    # auto: the C++ CPU kernels on CPU when they build (else torch), Triton's kernels on CUDA
    # (torch when triton is missing); torch: the reference (any device); cpu: the C++ kernels;
    # triton: Triton's kernels (CUDA, or a CPU under TRITON_INTERPRET=1). RMSNorm/RoPE/SiLU
    # kernels follow GEARSHIFT_CPU_KERNELS instead.
    attention_backend: str = "auto"
    # CPU matmul weights: auto picks oneDNN-packed bf16/fp16 where this CPU runs them natively
    # (kernels/cpu_features.py), plain F.linear otherwise; plain forces F.linear; onednn insists.
    weight_packing: str = "auto"
    # vLLM's flag: never replay decode steps from CUDA graphs (launch/rank_graphs).
    enforce_eager: bool = False
    # The most sequences a decode step may hold and still replay a graph (vLLM's
    # max_cudagraph_capture_size); larger steps run eagerly.
    max_cudagraph_capture_size: int = 512
    # Tests: off CUDA, run decode steps through the graph runner anyway, with capture replaced
    # by direct calls (the bookkeeping a GPU replays; slower than eager on a CPU).
    graphs_on_cpu: bool = False
    # Fused elementwise kernels (RMSNorm + residual, RoPE, SiLU x mul) on CUDA: auto measures
    # fused against unfused for this model's shapes at start-up and keeps the faster; on; off.
    fused_elementwise: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size == 0:
            object.__setattr__(self, "block_size", 64 if self.device == "cpu" else 16)
        for name in ("num_threads", "prefill_threads"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise InvalidRequestError(name, f"{name} must be positive, got {value}")
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_cudagraph_capture_size",
        ):
            if getattr(self, name) <= 0:
                raise InvalidRequestError(
                    name, f"{name} must be positive, got {getattr(self, name)}"
                )
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise InvalidRequestError(
                "max_model_len", f"max_model_len must be > 1, got {self.max_model_len}"
            )
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise InvalidRequestError("kv_cache_bytes", "kv_cache_bytes must be positive")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InvalidRequestError(
                "gpu_memory_utilization", "gpu_memory_utilization must be in (0, 1]"
            )
        check_attention_backend(self.attention_backend, self.device)
        if self.fused_elementwise not in FUSED_CHOICES:
            raise InvalidRequestError(
                "fused_elementwise",
                f"fused_elementwise {self.fused_elementwise!r} is not one of "
                f"{', '.join(FUSED_CHOICES)}",
            )
        if self.weight_packing not in PACKINGS:
            raise InvalidRequestError(
                "weight_packing",
                f"weight_packing {self.weight_packing!r} is not one of {', '.join(PACKINGS)}",
            )
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise InvalidRequestError(
                "dtype", f"dtype {self.dtype!r} is not one of auto, {', '.join(sorted(_DTYPES))}"
            )


def check_attention_backend(backend: str, device: str) -> None:
    """Refuse, naming the field, a backend that does not exist or cannot run on ``device`` here
    (triton on a CPU without Triton's interpreter); called before any rank starts."""
    if backend not in ATTENTION_BACKENDS:
        raise InvalidRequestError(
            "attention_backend",
            f"attention_backend {backend!r} is not one of {', '.join(ATTENTION_BACKENDS)}",
        )
    if backend == "triton":
        reason = triton_mode.refusal(device)
        if reason is not None:
            raise InvalidRequestError("attention_backend", reason)


def resolve_dtype(name: str, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    """``auto`` takes the checkpoint's dtype (bf16 when it has none, e.g. quantised GGUF)."""
    import torch

    if name != "auto":
        return getattr(torch, _DTYPES[name])
    dtype = getattr(torch, _DTYPES.get(checkpoint_dtype or "", "bfloat16"))
    if dtype == torch.float16 and device.type == "cpu":
        return torch.bfloat16  # fp16 matmuls are slow on CPUs; bf16 has the same footprint
    return dtype
