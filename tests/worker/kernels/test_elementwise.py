"""RMSNorm, fused add + RMSNorm, RoPE and SiLU-and-mul kernels against the torch reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gearshift.worker import kernels
from gearshift.worker.model.layers.activation import silu_and_mul
from gearshift.worker.model.layers.norm import RMSNorm
from gearshift.worker.model.layers.rotary import rotate, rotate_reference

pytestmark = pytest.mark.usefixtures("cpu_kernels")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _norm(size: int, dtype: torch.dtype, seed: int = 0) -> RMSNorm:
    g = torch.Generator().manual_seed(seed)
    norm = RMSNorm(size, 1e-5, dtype, torch.device("cpu"))
    norm.weight.data.copy_(1.0 + 0.2 * torch.randn(size, generator=g))
    return norm


def _rand(*shape: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (2.0 * torch.randn(*shape, generator=g)).to(dtype)


def _assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: same up to summation order; bf16/fp16: equal, or one ulp where a sum of squares in a
    different order lands the fp32 value on the other side of a rounding boundary."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        return
    ulp = torch.finfo(got.dtype).eps
    torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=ulp)
    assert (got != want).float().mean() < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 576), (33, 100), (3, 5, 64)])
def test_rms_norm_matches_reference(dtype, shape):
    norm = _norm(shape[-1], dtype)
    x = _rand(*shape, dtype=dtype)
    _assert_matches(norm(x), norm.reference(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_per_head_views_of_a_fused_projection(dtype):
    # Qwen3's q/k norm runs on [T, H, D] slices of the QKV output: strided rows.
    qkv = _rand(9, 12 * 32, dtype=dtype)
    heads = qkv[:, : 8 * 32].view(9, 8, 32)[:, 2:6]
    assert not heads.is_contiguous()
    norm = _norm(32, dtype)
    _assert_matches(norm(heads), norm.reference(heads.contiguous()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_returns_the_rounded_sum_and_its_norm_keeping_the_residual(dtype):
    norm = _norm(576, dtype)
    x, residual = _rand(32, 576, dtype=dtype, seed=2), _rand(32, 576, dtype=dtype, seed=3)
    x_before, residual_before = x.clone(), residual.clone()
    normed, total = norm.add_forward(x, residual)
    expected_total = x_before + residual_before
    assert torch.equal(total, expected_total)  # one torch add: exactly the same rounding
    assert torch.equal(residual, residual_before)
    _assert_matches(normed, norm.reference(expected_total))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_has_vllm_in_place_semantics(dtype):
    norm = _norm(64, dtype)
    x, residual = _rand(5, 64, dtype=dtype, seed=4), _rand(5, 64, dtype=dtype, seed=5)
    expected_residual = x + residual
    expected = norm.reference(expected_residual)
    kernels.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    assert torch.equal(residual, expected_residual)
    _assert_matches(x, expected)


def test_rms_norm_rejects_a_weight_of_another_size():
    with pytest.raises(RuntimeError, match="weight must be"):
        kernels.rms_norm(torch.randn(2, 8), torch.ones(7), 1e-5)


def _rope_tables(tokens: int, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(6))
    inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(positions.float(), inv)
    return freqs.cos().to(dtype).unsqueeze(1), freqs.sin().to(dtype).unsqueeze(1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 32, 6])
def test_rotary_is_bit_exact_with_the_reference_on_a_strided_qk_view(dtype, dim):
    tokens, hq, hkv = 11, 9, 3
    qkv = _rand(tokens, (hq + 2 * hkv) * dim, dtype=dtype)
    qk = qkv[:, : (hq + hkv) * dim].view(tokens, hq + hkv, dim)
    assert not qk.is_contiguous()
    cos, sin = _rope_tables(tokens, dim, dtype)
    expected = rotate_reference(qk, cos, sin)
    assert torch.equal(rotate(qk, cos, sin), expected)
    v_before = qkv[:, (hq + hkv) * dim :].clone()
    kernels.rotary_embedding_(qk, cos, sin)
    assert torch.equal(qk, expected)
    assert torch.equal(qkv[:, (hq + hkv) * dim :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (32, 2 * 1536), (5, 2 * 37), (2, 3, 2 * 64)])
def test_silu_and_mul_matches_reference(dtype, shape):
    x = _rand(*shape, dtype=dtype, seed=7) * 3
    gate, up = x.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    got = silu_and_mul(x)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=2e-6)
    else:
        _assert_matches(got, expected)


def test_silu_and_mul_of_extreme_values_is_finite_like_torch():
    x = torch.tensor([[-200.0, -90.0, -20.0, 0.0, 20.0, 90.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(silu_and_mul(x), F.silu(gate) * up, atol=1e-30, rtol=2e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 15, 16, 17, 49152 + 7])
def test_argmax_matches_torch_on_random_rows(dtype, n):
    x = _rand(5, n, dtype=dtype, seed=n)
    assert torch.equal(kernels.argmax(x), x.argmax(dim=-1))
    strided = _rand(5, 2 * n, dtype=dtype, seed=n + 1)[:, ::2]
    assert torch.equal(kernels.argmax(strided), strided.argmax(dim=-1))


def test_argmax_takes_the_first_maximum_and_the_first_nan_like_torch():
    inf, nan = float("inf"), float("nan")
    rows = torch.full((6, 40), -1.0)
    rows[0, [3, 19, 35]] = 5.0  # ties in different lanes: the first wins
    rows[1, [20, 4]] = 5.0
    rows[2, [7, 30]] = nan  # NaN beats everything, the first one wins
    rows[2, 1] = inf
    rows[3] = -inf  # all -inf: index 0
    rows[4, 39] = inf  # the tail past the last full 16-lane chunk
    rows[5, [33, 38]] = nan
    assert torch.equal(kernels.argmax(rows), rows.argmax(dim=-1))
    assert kernels.argmax(rows).tolist() == [3, 4, 7, 0, 39, 33]
