"""What this CPU can run: its instruction-set flags, the weight packing and the kernel ISA to use.

Chosen once per process from ``/proc/cpuinfo`` and torch's own oneDNN checks, so that every dtype
runs on every x86-64 CPU torch supports. oneDNN's pre-packed fp16 weights need avx512_fp16 or
avx_ne_convert (without them ``mkldnn_reorder_linear_weight`` raises, e.g. on AMD EPYC with
AVX-512 bf16 but no fp16); pre-packed bf16 weights are only fast with native bf16 dot products
(avx512_bf16 or AMX). Everything else runs the plain ``F.linear`` path by default; fp32 can be
packed on request (``weight_packing: onednn``): on an AMD EPYC that makes small-batch matmuls
2-7x faster than torch's MKL sgemm, but every new row count costs oneDNN a primitive
(``benchmarks/fp32_packing.py``, ``benchmarks/README.md``).
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from gearshift.worker.config import PACKINGS

log = logging.getLogger(__name__)

# GEARSHIFT_CPU_ISA: which -march the C++ kernels are built for. ``native`` is this CPU; the
# x86-64 levels force a portable build (tests use them to cover the paths other CPUs take).
ISA_ENV = "GEARSHIFT_CPU_ISA"
ISA_MARCH = {
    "native": "native",
    "avx512": "x86-64-v4",  # AVX-512 F/BW/DQ/VL: the hand-written AVX-512 paths
    "avx2": "x86-64-v3",  # AVX2 + FMA: portable loops, auto-vectorised
    "generic": "x86-64-v2",  # SSE4.2: any x86-64 CPU torch supports
}
# Flags each forced level needs from the host to run at all.
ISA_NEEDS = {
    "avx512": frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl"}),
    "avx2": frozenset({"avx2", "fma"}),
    "generic": frozenset({"sse4_2"}),
}
_BF16_NATIVE = frozenset({"avx512_bf16", "amx_bf16"})
_FP16_NATIVE = frozenset({"avx512_fp16", "avx_ne_convert", "amx_fp16"})


def cpuinfo_flags_line() -> str:
    """The ``flags`` line of /proc/cpuinfo (``Features`` on Arm), else the processor name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


@dataclass(frozen=True)
class CpuFeatures:
    """The host's instruction-set flags and what torch's oneDNN build says it supports."""

    flags: frozenset[str]
    onednn: bool  # torch was built with oneDNN (mkldnn)
    onednn_bf16: bool  # torch.ops.mkldnn._is_mkldnn_bf16_supported()
    onednn_fp16: bool  # torch.ops.mkldnn._is_mkldnn_fp16_supported()

    @staticmethod
    def detect() -> CpuFeatures:
        line = cpuinfo_flags_line()
        flags = frozenset(line.split(":", 1)[-1].split())
        onednn = bool(torch.backends.mkldnn.is_available())
        bf16 = fp16 = False
        if onednn:
            bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
            fp16 = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        return CpuFeatures(flags, onednn, bf16, fp16)

    def onednn_packing(self, dtype: torch.dtype) -> tuple[bool, str]:
        """Whether oneDNN-packed weights of ``dtype`` run (fast) here, and why (for the log)."""
        if dtype == torch.float32:
            return False, "fp32 runs plain F.linear (oneDNN only when asked for)"
        if dtype not in (torch.bfloat16, torch.float16):
            return False, f"{dtype} has no packed path"
        if not self.onednn:
            return False, "torch has no oneDNN"
        if dtype == torch.bfloat16:
            native = sorted(self.flags & _BF16_NATIVE)
            if self.onednn_bf16 and native:
                return True, f"oneDNN bf16 with {', '.join(native)}"
            return False, "no avx512_bf16/amx_bf16 (packed bf16 would be emulated)"
        native = sorted(self.flags & _FP16_NATIVE)
        if self.onednn_fp16 and native:
            return True, f"oneDNN fp16 with {', '.join(native)}"
        return False, "no avx512_fp16/avx_ne_convert (oneDNN refuses packed fp16)"

    def can_run_isa(self, isa: str) -> bool:
        """Whether kernels built for ``isa`` (a key of ISA_MARCH) run on this CPU."""
        return isa == "native" or ISA_NEEDS[isa] <= self.flags

    @property
    def avx512(self) -> bool:
        return "avx512f" in self.flags


# Process-wide on purpose: the CPU does not change under a running process, and every layer asks.
@functools.cache
def host_features() -> CpuFeatures:
    """This host's features, detected once."""
    return CpuFeatures.detect()


def choose_packing(
    dtype: torch.dtype,
    device: torch.device,
    requested: str = "auto",
    features: CpuFeatures | None = None,
) -> str:
    """``onednn`` or ``plain`` for the weights of one model; logged once per load.

    ``requested``: ``auto`` picks from the CPU; ``plain`` forces F.linear (always runs);
    ``onednn`` insists on packing and raises ValueError where this CPU cannot run it.
    """
    if requested not in PACKINGS:
        raise ValueError(f"weight packing {requested!r} is not one of {', '.join(PACKINGS)}")
    if device.type != "cpu":
        return "plain"
    features = features or host_features()
    ok, why = features.onednn_packing(dtype)
    if requested == "plain":
        choice, why = "plain", "forced plain"
    elif requested == "onednn" and not ok:
        if dtype != torch.float32 or not features.onednn:
            raise ValueError(f"weight packing onednn cannot run {dtype} on this CPU: {why}")
        choice, why = "onednn", "forced (oneDNN runs fp32 on every x86-64 CPU)"
    else:
        choice = "onednn" if ok else "plain"
    log.info("CPU weight packing for %s: %s (%s)", str(dtype).removeprefix("torch."), choice, why)
    return choice


def kernel_isa() -> str:
    """The ISA the C++ kernels are built for: $GEARSHIFT_CPU_ISA, default ``native``."""
    isa = os.environ.get(ISA_ENV, "native").strip() or "native"
    if isa not in ISA_MARCH:
        raise ValueError(f"{ISA_ENV}={isa!r} is not one of {', '.join(ISA_MARCH)}")
    return isa
