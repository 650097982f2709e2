"""Pick the attention core an engine runs (every rank of a group picks the same)."""

from __future__ import annotations

import logging

import torch

from gearshift.worker import kernels
from gearshift.worker.attention.core import AttentionCore
from gearshift.worker.attention.cpu_backend import CpuAttention
from gearshift.worker.attention.torch_ref import TorchAttention
from gearshift.worker.attention.triton import mode as triton_mode
from gearshift.worker.attention.triton_backend import TritonAttention
from gearshift.worker.config import EngineConfig, check_attention_backend
from gearshift.worker.errors import InvalidRequestError

log = logging.getLogger(__name__)


def make_attention(config: EngineConfig, head_dim: int) -> AttentionCore:
    """``attention_backend``: auto (on CPU the C++ kernels when they build, else torch; on CUDA
    Triton's kernels, torch when triton is missing), torch (the reference, every device), cpu
    (the C++ kernels; torch with a warning if they cannot build) or triton (CUDA, or a CPU under
    Triton's interpreter; refused elsewhere).
    """
    scale = head_dim**-0.5
    backend = config.attention_backend
    device = torch.device(config.device)
    on_cpu = device.type == "cpu"
    if backend == "cpu" and not on_cpu:
        raise InvalidRequestError(
            "attention_backend", f"attention_backend=cpu needs device=cpu, not {config.device}"
        )
    # EngineConfig checked it when built; the environment (TRITON_INTERPRET) may have changed.
    check_attention_backend(backend, config.device)
    if device.type == "cuda":
        # cuDNN's SDPA builds an execution plan for every new shape, and prefill chunks come in
        # every length: on an H200 (torch 2.11) the first job of 64 requests took 4.9 s with it
        # and 2.8 s without (1.4 vs 1.3 s once every shape had been seen). Flash and
        # memory-efficient attention have no per-shape setup. Process-wide: a rank owns its
        # process.
        torch.backends.cuda.enable_cudnn_sdp(False)
    if backend == "triton":
        return TritonAttention(scale)
    if backend == "auto" and device.type == "cuda":
        if triton_mode.triton_installed():
            return TritonAttention(scale)
        log.warning("attention_backend=auto: triton is not installed, using torch on CUDA")
        return TorchAttention(scale)
    if backend == "torch" or not on_cpu:
        return TorchAttention(scale)
    if kernels.available():  # builds the kernels on first use (cached afterwards)
        return CpuAttention(scale)
    if backend == "cpu":
        log.warning("attention_backend=cpu: the CPU kernels are unavailable, using torch")
    return TorchAttention(scale)
