"""Which fused elementwise kernels (layers/fused_triton.py) a model on CUDA runs, chosen by
measurement at start-up (issue 27, Build 5).

``fused_elementwise=auto`` times each fused kernel against the torch ops it replaces, at this
model's shapes (its hidden size, its rank's heads and intermediate size, in its dtype) and at a
decode-sized and a prefill-sized token count, and keeps a kernel only where it is faster over
both; ``on`` and ``off`` skip the measurement. The choice is logged and kept on the model
(``fused_choice``). Off CUDA nothing changes: the C++ CPU kernels already fuse these ops.
RoPE is not fused with the KV write: the write belongs to the attention core, behind its
interface, and the two meet only inside a backend.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gearshift.worker.model.layers import fused_triton
from gearshift.worker.model.layers.norm import RMSNorm
from gearshift.worker.model.layers.rotary import rotate_reference
from gearshift.worker.model.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
)

log = logging.getLogger(__name__)

OPS = ("add_rms_norm", "rotary", "silu_and_mul")


@dataclass(frozen=True)
class FusedChoice:
    """Which fused kernels run, and the measured milliseconds (fused, unfused) behind it."""

    add_rms_norm: bool = False
    rotary: bool = False
    silu_and_mul: bool = False
    timings: tuple[tuple[str, float, float], ...] = ()

    @classmethod
    def every(cls, on: bool) -> FusedChoice:
        return cls(on, on, on)


def apply(model: LlamaForCausalLM, choice: FusedChoice) -> None:
    """Switch ``model``'s layers to the chosen kernels (and the others back to torch)."""
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.fused = choice.add_rms_norm
        elif isinstance(module, LlamaAttention):
            module.fused_rope = choice.rotary
        elif isinstance(module, LlamaMLP):
            module.fused_silu = choice.silu_and_mul
    model.fused_choice = choice


def choose(
    mode: str, model: LlamaForCausalLM, token_counts: tuple[int, ...], rank: int = 0
) -> FusedChoice | None:
    """The kernels ``model`` runs for ``mode`` (auto, on, off); None off CUDA (nothing to do)."""
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    if device.type != "cuda":
        return None
    if mode == "off":
        return FusedChoice.every(False)
    if not fused_triton.available():
        log.warning("fused elementwise kernels need triton, which does not import: torch ops")
        return FusedChoice.every(False)
    if mode == "on":
        return FusedChoice.every(True)
    choice = measure(model, token_counts, device)
    log.info(
        "rank %d fused elementwise kernels (fused / torch ms over %s tokens): %s",
        rank,
        list(token_counts),
        ", ".join(
            f"{name} {'on' if getattr(choice, name) else 'off'} ({f:.3f} / {u:.3f})"
            for name, f, u in choice.timings
        ),
    )
    return choice


def _shapes(model: LlamaForCausalLM) -> tuple[int, int, int, int] | None:
    """(hidden, q + kv heads on this rank, head dim, intermediate on this rank), or None for a
    rank without decoder layers."""
    layers = [layer for layer in model.model.layers if isinstance(layer, LlamaDecoderLayer)]
    if not layers:
        return None
    attn, mlp = layers[0].self_attn, layers[0].mlp
    inter = model.config.intermediate_size // model.tp.size
    if isinstance(mlp, LlamaMLP):
        inter = mlp.gate_up_proj.local_sizes[0]
    return model.config.hidden_size, attn.num_heads + attn.num_kv_heads, attn.head_dim, inter


def _pairs(
    tokens: int, shapes: tuple[int, int, int, int], norm: RMSNorm
) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """(fused, torch) calls of every op over random inputs of ``tokens`` rows."""
    hidden, heads, dim, inter = shapes
    dtype, device = norm.weight.dtype, norm.weight.device
    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    res = torch.randn_like(x)
    qk = torch.randn(tokens, heads, dim, dtype=dtype, device=device)
    cos = torch.randn(tokens, 1, dim // 2, dtype=dtype, device=device)
    sin = torch.randn_like(cos)
    gate_up = torch.randn(tokens, 2 * inter, dtype=dtype, device=device)
    return {
        "add_rms_norm": (
            lambda: fused_triton.add_rms_norm(x, res, norm.weight, norm.eps),
            lambda: norm.reference(x + res),
        ),
        "rotary": (
            lambda: fused_triton.rotary(qk, cos, sin),
            lambda: rotate_reference(qk, cos, sin),
        ),
        "silu_and_mul": (
            lambda: fused_triton.silu_and_mul(gate_up),
            lambda: F.silu(gate_up[:, :inter]) * gate_up[:, inter:],
        ),
    }


def measure(
    model: LlamaForCausalLM, token_counts: tuple[int, ...], device: torch.device
) -> FusedChoice:
    """Time each fused kernel against its torch ops at ``model``'s shapes (CUDA events)."""
    shapes = _shapes(model)
    if shapes is None:
        return FusedChoice.every(False)
    norm = RMSNorm(shapes[0], model.config.rms_norm_eps, next(model.parameters()).dtype, device)
    norm.weight.data.normal_()
    fused = dict.fromkeys(OPS, 0.0)
    plain = dict.fromkeys(OPS, 0.0)
    for tokens in token_counts:
        for name, (a, b) in _pairs(tokens, shapes, norm).items():
            f, u = _race(a, b)
            fused[name] += f
            plain[name] += u
    return FusedChoice(
        add_rms_norm=fused["add_rms_norm"] < plain["add_rms_norm"],
        rotary=fused["rotary"] < plain["rotary"],
        silu_and_mul=fused["silu_and_mul"] < plain["silu_and_mul"],
        timings=tuple((name, fused[name], plain[name]) for name in OPS),
    )


def _race(a: Callable[[], object], b: Callable[[], object], reps: int = 20) -> tuple[float, float]:
    """Milliseconds per call of ``a`` and ``b``: the best of three interleaved rounds each."""
    best = [float("inf"), float("inf")]
    for fn in (a, b):  # warm-up: compilation, autotuning, allocator
        fn()
    for _ in range(3):
        for i, fn in enumerate((a, b)):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            end.synchronize()
            best[i] = min(best[i], start.elapsed_time(end) / reps)
    return best[0], best[1]
