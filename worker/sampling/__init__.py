"""Sampling parameters and the batched sampler that picks each step's next tokens."""

from __future__ import annotations

from gearshift.worker.sampling.logprobs import TokenLogprobs
from gearshift.worker.sampling.masks import apply_min_p, apply_top_k, apply_top_k_top_p, apply_top_p
from gearshift.worker.sampling.params import InvalidSamplingParams, SamplingParams
from gearshift.worker.sampling.sampler import Sampler, SamplerOutput, SamplingState

__all__ = [
    "InvalidSamplingParams",
    "Sampler",
    "SamplerOutput",
    "SamplingParams",
    "SamplingState",
    "TokenLogprobs",
    "apply_min_p",
    "apply_top_k",
    "apply_top_k_top_p",
    "apply_top_p",
]
