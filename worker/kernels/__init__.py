"""C++ CPU kernels (JIT-built torch extension): paged decode attention, RMSNorm, RoPE, SiLU-and-mul,
argmax, and a whole decoder layer for pure-decode steps.

``available()`` says whether they are loaded; every caller keeps a torch reference path for when
they are not (no compiler, ``GEARSHIFT_CPU_KERNELS=0``, non-CPU tensors).
"""

from __future__ import annotations

from gearshift.worker.kernels.ops import (
    add_rms_norm,
    argmax,
    available,
    decode_layer,
    fused_add_rms_norm,
    paged_decode_attention,
    rms_norm,
    rotary_embedding,
    rotary_embedding_,
    silu_and_mul,
    usable,
    write_kv,
)

__all__ = [
    "add_rms_norm",
    "argmax",
    "available",
    "decode_layer",
    "fused_add_rms_norm",
    "paged_decode_attention",
    "rms_norm",
    "rotary_embedding",
    "rotary_embedding_",
    "silu_and_mul",
    "usable",
    "write_kv",
]
