"""Dequantising GGUF blocks in torch: the three legacy block formats the embedded SmolLM2 file
and most small Llama GGUFs use (Q4_0, Q4_1, Q8_0).

``gguf.quants.dequantize`` does the same in numpy through a Python-level loop over row groups:
0.7-1.6 s for the embedded file's tensors on one core of the 2-core dev machine, against
0.4-0.5 s here (each format is a few whole-tensor torch ops); ``gearshift generate`` with
SmolLM2 went from 5.1-5.3 s to 4.2-4.7 s warm. The arithmetic is the reference's, op for op in
fp32 (a product, then a sum: no fused multiply-add), so the result is bitwise the same
(``tests/worker/model/test_gguf_dequant.py`` checks it against ``gguf`` on every tensor of the
embedded file and on random blocks). Other formats go to ``gguf``.

Layouts (ggml's ``block_q4_0``/``block_q4_1``/``block_q8_0``, 32 weights a block): an fp16 scale
``d`` (Q4_1: then an fp16 minimum ``m``), then the quants: Q8_0 32 int8; Q4_* 16 bytes whose low
nibbles are weights 0-15 and high nibbles weights 16-31.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

_Q = gguf.GGMLQuantizationType
SUPPORTED = frozenset({_Q.Q4_0, _Q.Q4_1, _Q.Q8_0})


def supported(qtype: int) -> bool:
    return int(qtype) in SUPPORTED


def _f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    return torch.cat((qs & 0x0F, qs >> 4), dim=1)


def dequantize(rows: np.ndarray, qtype: int) -> torch.Tensor:
    """fp32 weights of ``rows``: uint8 bytes of whole blocks of a ``supported`` type, the last
    axis a quantised row; the result has the same leading shape."""
    qtype = _Q(int(qtype))
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = np.ascontiguousarray(rows, dtype=np.uint8)
    if not raw.flags.writeable:  # a read-only memory map: torch warns on wrapping one
        raw = raw.copy()
    if raw.shape[-1] % size:
        raise ValueError(f"a row of {raw.shape[-1]} bytes is not whole blocks of {size}")
    b = torch.from_numpy(raw).reshape(-1, size)
    d = _f16(b[:, 0:2])
    if qtype == _Q.Q8_0:
        out = b[:, 2:].contiguous().view(torch.int8).to(torch.float32) * d
    elif qtype == _Q.Q4_1:
        m = _f16(b[:, 2:4])
        out = d * _nibbles(b[:, 4:]).to(torch.float32) + m
    else:  # Q4_0: nibbles are offset by 8
        out = d * (_nibbles(b[:, 2:]).to(torch.int8) - 8).to(torch.float32)
    return out.reshape(*raw.shape[:-1], -1)
