"""Pick the attention core an engine runs (every rank of a group picks the same)."""

from __future__ import annotations

import logging

import torch

from gearshift.worker import kernels
from gearshift.worker.attention.core import AttentionCore
from gearshift.worker.attention.cpu_backend import CpuAttention
from gearshift.worker.attention.torch_ref import TorchAttention
from gearshift.worker.config import EngineConfig
from gearshift.worker.errors import InvalidRequestError

log = logging.getLogger(__name__)


def make_attention(config: EngineConfig, head_dim: int) -> AttentionCore:
    """``attention_backend``: auto (the C++ kernels on CPU when they build, else torch), torch
    (the reference, every device) or cpu (the kernels; torch with a warning if they cannot build).
    """
    scale = head_dim**-0.5
    backend = config.attention_backend
    on_cpu = torch.device(config.device).type == "cpu"
    if backend == "cpu" and not on_cpu:
        raise InvalidRequestError(
            "attention_backend", f"attention_backend=cpu needs device=cpu, not {config.device}"
        )
    if not on_cpu and torch.device(config.device).type == "cuda":
        # cuDNN's SDPA builds an execution plan for every new shape, and prefill chunks come in
        # every length: on an H200 (torch 2.11) the first job of 64 requests took 4.9 s with it
        # and 2.8 s without (1.4 vs 1.3 s once every shape had been seen). Flash and
        # memory-efficient attention have no per-shape setup. Process-wide: a rank owns its
        # process.
        torch.backends.cuda.enable_cudnn_sdp(False)
    if backend == "torch" or not on_cpu:
        return TorchAttention(scale)
    if kernels.available():  # builds the kernels on first use (cached afterwards)
        return CpuAttention(scale)
    if backend == "cpu":
        log.warning("attention_backend=cpu: the CPU kernels are unavailable, using torch")
    return TorchAttention(scale)
