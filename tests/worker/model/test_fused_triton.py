"""The fused elementwise Triton kernels against the torch ops they replace.

Without a GPU they run under Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set
before the kernels are first made); with one, on CUDA tensors. fp32 results must match the torch
code to rounding (the only difference is the order of the norm's sum); bf16 within bf16's own
tolerance.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch
import torch.nn.functional as F

from gearshift.worker.model.layers import fused_triton
from gearshift.worker.model.layers.norm import RMSNorm
from gearshift.worker.model.layers.rotary import rotate_reference

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
if not torch.cuda.is_available() and "triton" not in sys.modules:
    # triton wraps its own library (tl.sum, tl.sigmoid) for one mode when it is first imported:
    # import it with the interpreter chosen, then put the variable back (tests set it each).
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP32 = {"atol": 1e-6, "rtol": 1e-5}


@pytest.fixture(autouse=True)
def interpreter_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU: every test runs the kernels in Triton's interpreter (set for this test only)."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def _norm(hidden: int, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(hidden, 1e-5, dtype, DEVICE)
    norm.weight.data.copy_(1.0 + 0.1 * torch.randn(hidden, dtype=dtype, device=DEVICE))
    return norm


@pytest.mark.parametrize("hidden", [64, 96, 200])
def test_add_rms_norm_equals_the_sum_then_the_torch_norm(hidden: int) -> None:
    torch.manual_seed(hidden)
    norm = _norm(hidden, torch.float32)
    # Rows of a wider tensor: the kernel honours the row stride.
    wide = torch.randn(7, hidden + 5, device=DEVICE)
    x, residual = wide[:, :hidden], torch.randn(7, hidden, device=DEVICE)
    want_sum = x + residual
    want = norm.reference(want_sum)
    out, total = fused_triton.add_rms_norm(x, residual, norm.weight, norm.eps)
    torch.testing.assert_close(total, want_sum, **FP32)
    assert total.data_ptr() == x.data_ptr()  # the sum lands in x, as add_forward allows
    torch.testing.assert_close(out, want, **FP32)


def test_rms_norm_without_a_residual_equals_torch() -> None:
    torch.manual_seed(1)
    norm = _norm(96, torch.float32)
    x = torch.randn(5, 96, device=DEVICE) * 3
    torch.testing.assert_close(fused_triton.rms_norm(x, norm.weight, norm.eps), norm.reference(x),
                               **FP32)  # fmt: skip


@pytest.mark.parametrize("dim", [32, 64, 128])
def test_rotary_equals_rotate_half_on_a_strided_qk_view(dim: int) -> None:
    torch.manual_seed(dim)
    tokens, q_heads, kv_heads = 5, 6, 2
    heads = q_heads + kv_heads
    # q and k side by side in a fused qkv output, as the model rotates them.
    qkv = torch.randn(tokens, (heads + kv_heads) * dim, device=DEVICE)
    qk = qkv[:, : heads * dim].view(tokens, heads, dim)
    cos = torch.randn(tokens, 1, dim // 2, device=DEVICE)
    sin = torch.randn(tokens, 1, dim // 2, device=DEVICE)
    torch.testing.assert_close(fused_triton.rotary(qk, cos, sin), rotate_reference(qk, cos, sin),
                               **FP32)  # fmt: skip


@pytest.mark.parametrize("inter", [40, 1500])
def test_silu_and_mul_equals_torch(inter: int) -> None:
    torch.manual_seed(inter)
    x = torch.randn(4, 2 * inter, device=DEVICE) * 2
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(fused_triton.silu_and_mul(x), F.silu(gate) * up, **FP32)


def test_bf16_results_are_within_bf16_rounding_of_the_exact_result() -> None:
    # Against the same maths in fp32 on the same bf16 inputs: two roundings apart at most (a
    # product rounded, then the sum), whatever rounding the interpreter's bf16 casts use.
    torch.manual_seed(3)
    bf16 = torch.bfloat16
    close = {"atol": 0.03, "rtol": 0.02}
    norm = _norm(64, bf16)
    x = torch.randn(3, 64, dtype=bf16, device=DEVICE)
    res = torch.randn(3, 64, dtype=bf16, device=DEVICE)
    exact = _norm(64, torch.float32)
    exact.weight.data.copy_(norm.weight.float())
    got = fused_triton.add_rms_norm(x.clone(), res, norm.weight, 1e-5)[0]
    torch.testing.assert_close(got.float(), exact.reference(x.float() + res.float()), **close)
    qk = torch.randn(3, 4, 32, dtype=bf16, device=DEVICE)
    cos, sin = (torch.randn(3, 1, 16, dtype=bf16, device=DEVICE) for _ in range(2))
    want = rotate_reference(qk.float(), cos.float(), sin.float())
    torch.testing.assert_close(fused_triton.rotary(qk, cos, sin).float(), want, **close)
    g = torch.randn(3, 80, dtype=bf16, device=DEVICE)
    want = F.silu(g[:, :40].float()) * g[:, 40:].float()
    torch.testing.assert_close(fused_triton.silu_and_mul(g).float(), want, **close)


def test_no_tokens_make_empty_outputs() -> None:
    assert fused_triton.rotary(torch.empty(0, 2, 8, device=DEVICE),
                               torch.empty(0, 1, 4, device=DEVICE),
                               torch.empty(0, 1, 4, device=DEVICE)).shape == (0, 2, 8)  # fmt: skip
    assert fused_triton.silu_and_mul(torch.empty(0, 8, device=DEVICE)).shape == (0, 4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU engines: the interpreter's run")
@pytest.mark.parametrize("family", ["llama2-bias", "qwen3"])
def test_a_model_with_every_fused_kernel_gives_the_unfused_logits(
    family, tiny_checkpoint, engine_factory
):
    from gearshift.worker.model import fused_ops
    from gearshift.worker.sampling.params import SamplingParams
    from tests.worker.helpers import run_recording

    folder = tiny_checkpoint(family)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    g = torch.Generator().manual_seed(2)
    schedule = {0: [(f"r{n}", torch.randint(0, 128, (n,), generator=g).tolist(), greedy)
                    for n in (3, 11)]}  # fmt: skip
    kw = {"attention_backend": "torch", "skip_tokenizer_init": True}
    plain = run_recording(engine_factory(folder, **kw), schedule)
    engine = engine_factory(folder, **kw)
    model = engine.executor.inner.model
    fused_ops.apply(model, fused_ops.FusedChoice.every(True))
    assert model.model.norm.fused and model.model.layers[0].mlp.fused_silu
    fused = run_recording(engine, schedule)
    assert fused.keys() == plain.keys()
    for rid, rows in plain.items():
        assert [c for c, _ in fused[rid]] == [c for c, _ in rows]
        for (_, got), (_, want) in zip(fused[rid], rows, strict=True):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_off_cuda_nothing_is_chosen_and_apply_sets_every_layer(tiny_checkpoint) -> None:
    from gearshift.worker.config import EngineConfig
    from gearshift.worker.engine.loading import inspect_model, load_model
    from gearshift.worker.model import fused_ops

    spec, source = inspect_model(
        EngineConfig(model=str(tiny_checkpoint("llama2-bias")), dtype="float32"),
        torch.device("cpu"),
    )
    model = load_model(spec, source, torch.device("cpu"))
    assert fused_ops.choose("auto", model, (4,)) is None  # the C++ kernels fuse these on CPU
    choice = fused_ops.FusedChoice(add_rms_norm=True, rotary=False, silu_and_mul=True)
    fused_ops.apply(model, choice)
    layer = model.model.layers[0]
    assert layer.input_layernorm.fused and not layer.self_attn.fused_rope and layer.mlp.fused_silu
    assert model.fused_choice == choice
