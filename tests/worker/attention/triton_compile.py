"""Compile every kernel launch of the triton backend with Triton's real compiler, for GPUs this
machine need not have: ``python -m tests.worker.attention.triton_compile`` (TRITON_INTERPRET unset).

The backend runs on CPU tensors with each launch replaced by ``triton.compile`` of the same
kernel, argument types and constants for sm_80 and sm_90 (ptxas included), so what the
interpreter accepts but the compiler refuses (a dot below 16 rows, a loop-carried type change, a
tile over the shared memory of the GPU) fails here, without a GPU. Prints one line per compiled
variant.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch

# Shared memory per block (bytes) a kernel may use on each target.
TARGETS = {80: 163 * 1024, 90: 227 * 1024}
POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}
POINTER_TYPES[torch.int64] = "*i64"


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: this compiles for real GPUs", file=sys.stderr)
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gearshift.worker.attention.triton import decode, kv_write, prefill
    from gearshift.worker.attention.triton_backend import TritonAttention
    from tests.worker.attention.triton_batches import make_batch

    seen: set[str] = set()

    def compile_instead(fn: Callable[..., Any]) -> Any:
        jitted = triton.jit(fn)

        class _Grid:
            def __getitem__(self, grid: tuple[int, ...]) -> Any:
                def launch(*args: Any, num_warps: int = 4, num_stages: int = 2, **consts: Any):
                    signature: dict[str, str] = {}
                    for name, value in zip(jitted.arg_names, args, strict=False):
                        if isinstance(value, torch.Tensor):
                            signature[name] = POINTER_TYPES[value.dtype]
                        elif isinstance(value, float):
                            signature[name] = "fp32"
                        else:
                            signature[name] = "i32" if abs(int(value)) < 2**31 else "i64"
                    signature.update({name: "constexpr" for name in consts})
                    key = f"{fn.__name__} {signature} {sorted(consts.items())} w{num_warps}"
                    if key in seen:
                        return
                    seen.add(key)
                    source = ASTSource(fn=jitted, signature=signature, constexprs=consts)
                    options = {"num_warps": num_warps, "num_stages": num_stages}
                    for arch, shared_limit in TARGETS.items():
                        binary = triton.compile(
                            source, target=GPUTarget("cuda", arch, 32), options=options
                        )
                        shared = binary.metadata.shared
                        assert shared <= shared_limit, f"{key}: {shared} B shared on sm_{arch}"
                        print(f"sm_{arch} {fn.__name__} {consts} warps={num_warps} shared={shared}")

                return launch

        return _Grid()

    for module in (decode, kv_write, prefill):
        module.kernel = compile_instead  # type: ignore[attr-defined]
    gpu_tiles = prefill.prefill_tiles
    # CPU tensors stand in for GPU ones: take the tiles a GPU launch takes.
    prefill.prefill_tiles = lambda dim, itemsize, on_gpu: gpu_tiles(dim, itemsize, True)  # type: ignore[assignment]
    # (dtype, head dim, GQA ratio, block size, KV heads): serving shapes in bf16 and fp16, a head
    # dim that is not a power of two, one KV head, and the fp32 the GPU tests compare in.
    cases = [
        (torch.bfloat16, 128, 4, 16, 2),
        (torch.bfloat16, 64, 8, 64, 2),
        (torch.float16, 96, 1, 16, 1),
        (torch.float32, 128, 8, 16, 2),
        (torch.float32, 32, 4, 16, 2),
    ]
    for dtype, head_dim, group, block_size, kv_heads in cases:
        # Decodes of a table wide enough for several KV splits, and prefill chunks; the kernels
        # are only compiled, so CPU tensors of the right types stand in for GPU ones.
        batch = make_batch(
            [700, 9], [(40, 100), (300, 300)], kv_heads=kv_heads, group=group, head_dim=head_dim,
            block_size=block_size, padding=1, dtype=dtype,
        )  # fmt: skip
        core = TritonAttention(head_dim**-0.5)
        core._sms = 132  # what an H100 reports: the split count of a GPU
        core.forward_lse(batch.q, batch.k, batch.v, batch.kv(), batch.meta)
        # One decode over a long table (several splits), two over a short one (one split: the
        # first kernel writes the output in the model's dtype).
        for lens in ([700], [9, 30]):
            step = make_batch(
                lens, [], kv_heads=kv_heads, group=group, head_dim=head_dim, block_size=block_size,
                dtype=dtype,
            )  # fmt: skip
            core.forward_lse(step.q, step.k, step.v, step.kv(), step.meta)
    print(f"compiled {len(seen)} variants")
    return 0


if __name__ == "__main__":
    sys.exit(main())
