"""Paged decode attention (KV write fused) and the CPU attention backend against the reference."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from gearshift.worker import kernels
from gearshift.worker.attention.cpu_backend import CpuAttention
from gearshift.worker.attention.metadata import AttentionMetadata
from gearshift.worker.attention.torch_ref import TorchAttention, write_kv
from tests.worker.helpers import scattered_block_tables

pytestmark = pytest.mark.usefixtures("cpu_kernels")

DIM = 64


@dataclass
class Batch:
    """Decoding sequences over a random paged cache; q/k/v are strided views of a fused QKV."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slots: torch.Tensor
    tables: torch.Tensor
    lens: torch.Tensor

    def meta(self) -> AttentionMetadata:
        return AttentionMetadata(
            num_decodes=len(self.lens),
            slot_mapping=self.slots,
            block_tables=self.tables,
            seq_lens=self.lens,
            max_decode_seq_len=int(self.lens.max()),
            prefill_starts=(),
            prefill_query_lens=(),
            prefill_seq_lens=(),
        )

    def to(self, dtype: torch.dtype) -> Batch:
        def conv(t: torch.Tensor) -> torch.Tensor:
            return t.to(dtype) if t.is_floating_point() else t

        return Batch(*(conv(getattr(self, f)) for f in Batch.__dataclass_fields__))


def make_batch(
    lens: list[int],
    kv_heads: int,
    group: int,
    block_size: int,
    dtype: torch.dtype,
    skip: tuple[int, ...] = (),
    seed: int = 0,
    dim: int = DIM,
) -> Batch:
    g = torch.Generator().manual_seed(seed)
    widths = [-(-n // block_size) for n in lens]
    num_blocks = sum(widths) + 3
    # A spare column.
    tables = scattered_block_tables(lens, block_size, num_blocks, max(widths) + 1, g)
    shape = (num_blocks, kv_heads, block_size, dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    hq = kv_heads * group
    qkv = torch.randn(len(lens), (hq + 2 * kv_heads) * dim, generator=g).to(dtype)
    q = qkv[:, : hq * dim].view(len(lens), hq, dim)
    k = qkv[:, hq * dim : (hq + kv_heads) * dim].view(len(lens), kv_heads, dim)
    v = qkv[:, (hq + kv_heads) * dim :].view(len(lens), kv_heads, dim)
    pos = torch.tensor(lens) - 1
    slots = tables[torch.arange(len(lens)), pos // block_size] * block_size + pos % block_size
    for b in skip:
        slots[b] = -1
    return Batch(q, k, v, k_cache, v_cache, slots, tables, torch.tensor(lens))


def reference(batch: Batch, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kv = (batch.k_cache.clone(), batch.v_cache.clone())
    write_kv(kv, batch.k, batch.v, batch.slots)
    out = TorchAttention(scale)._decode(batch.q, kv, batch.meta())
    return out, kv[0], kv[1]


def run_kernel(batch: Batch, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
    out = torch.empty(batch.q.shape, dtype=batch.q.dtype)
    kernels.paged_decode_attention(
        out, batch.q, batch.k, batch.v, kc, vc, batch.slots, batch.tables, batch.lens, scale
    )
    return out, kc, vc


LENGTHS = [1, 5, 17, 300, 64, 33, 2, 129]


@pytest.fixture(params=[1, 4], ids=["task-per-sequence", "task-per-head"])
def threads(request):
    """The kernel hands out whole sequences when a batch has >= 4 per thread, else single heads:
    one thread takes the 8-sequence batch per sequence, four threads (even on fewer cores) per head.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_equals_reference_in_fp32(group, block_size, threads):
    batch = make_batch(LENGTHS, 3, group, block_size, torch.float32, skip=(3,))
    scale = DIM**-0.5
    out, kc, vc = run_kernel(batch, scale)
    ref_out, ref_kc, ref_vc = reference(batch, scale)
    assert torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc)
    torch.testing.assert_close(out, ref_out, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(("dim", "group"), [(24, 2), (64, 9), (128, 8), (32, 5)])
def test_decode_equals_reference_for_other_head_sizes_and_groups(dim, group):
    # head_dim not a multiple of 16, or more than 8 query heads per KV head: the portable path.
    batch = make_batch([3, 40, 17], 2, group, 16, torch.float32, skip=(1,), dim=dim)
    out, kc, vc = run_kernel(batch, dim**-0.5)
    ref_out, ref_kc, ref_vc = reference(batch, dim**-0.5)
    assert torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc)
    torch.testing.assert_close(out, ref_out, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 3])
def test_decode_in_half_precision_is_the_fp32_result_rounded(dtype, group):
    # The kernel keeps scores and probabilities in fp32, so it lands within an ulp of the fp32
    # computation on the same inputs (closer than the bf16 reference, which rounds the scores).
    batch = make_batch(LENGTHS, 2, group, 16, dtype, skip=(0,))
    scale = DIM**-0.5
    out, kc, vc = run_kernel(batch, scale)
    exact, ref_kc, ref_vc = reference(batch.to(torch.float32), scale)
    assert torch.equal(kc, ref_kc.to(dtype)) and torch.equal(vc, ref_vc.to(dtype))
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out.float(), exact, atol=1e-3, rtol=eps)
    ref_out, _, _ = reference(batch, scale)
    assert (out.float() - exact).abs().max() <= (ref_out.float() - exact).abs().max()


def test_decode_never_reads_cache_slots_beyond_the_sequence():
    batch = make_batch([3, 18], 2, 2, 4, torch.float32)
    expected, _, _ = reference(batch, 0.125)
    # Stale slots hold garbage (masked out in the reference, skipped by the kernel).
    for b, n in enumerate([3, 18]):
        last = int(batch.tables[b, (n - 1) // 4])
        batch.k_cache[last, :, n % 4 or 4 :] = float("nan")
        batch.v_cache[last, :, n % 4 or 4 :] = float("nan")
    out, _, _ = run_kernel(batch, 0.125)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


def test_decode_rejects_a_block_outside_the_cache():
    batch = make_batch([9, 4], 1, 1, 4, torch.float32)
    batch.tables[1, 0] = batch.k_cache.shape[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        run_kernel(batch, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_equals_reference_and_skips_padding(dtype):
    batch = make_batch([4, 9, 30, 7], 3, 1, 4, dtype, skip=(1, 3))
    kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
    kernels.write_kv(batch.k, batch.v, kc, vc, batch.slots)
    kv = (batch.k_cache.clone(), batch.v_cache.clone())
    write_kv(kv, batch.k, batch.v, batch.slots)
    assert torch.equal(kc, kv[0]) and torch.equal(vc, kv[1])


def _mixed_step(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Three decodes, a prefill chunk with cached history, a fresh prefill, and padding."""
    g = torch.Generator().manual_seed(11)
    bs, hkv, hq, blocks = 4, 2, 6, 64
    decode_lens, chunk_hist, chunk_len, fresh_len, padding = [7, 30, 1], 9, 6, 5, 2
    lens = [*decode_lens, chunk_hist + chunk_len, fresh_len]
    tables = scattered_block_tables(lens, bs, blocks, 8, g)

    def slot(b: int, pos: int) -> int:
        return int(tables[b, pos // bs]) * bs + pos % bs

    slots = [slot(b, n - 1) for b, n in enumerate(decode_lens)]
    slots += [slot(3, p) for p in range(chunk_hist, chunk_hist + chunk_len)]
    slots += [slot(4, p) for p in range(fresh_len)] + [-1] * padding
    tokens = len(slots)
    meta = AttentionMetadata(
        num_decodes=3,
        slot_mapping=torch.tensor(slots),
        block_tables=tables,
        seq_lens=torch.tensor(lens),
        max_decode_seq_len=max(decode_lens),
        prefill_starts=(3, 3 + chunk_len),
        prefill_query_lens=(chunk_len, fresh_len),
        prefill_seq_lens=(chunk_hist + chunk_len, fresh_len),
        num_padding=padding,
    )
    k_cache = torch.randn(blocks, hkv, bs, DIM, generator=g).to(dtype)
    v_cache = torch.randn(blocks, hkv, bs, DIM, generator=g).to(dtype)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * DIM, generator=g).to(dtype)
    q = qkv[:, : hq * DIM].view(tokens, hq, DIM)
    k = qkv[:, hq * DIM : (hq + hkv) * DIM].view(tokens, hkv, DIM)
    v = qkv[:, (hq + hkv) * DIM :].view(tokens, hkv, DIM)
    return q, k, v, k_cache, v_cache, meta


def test_cpu_backend_equals_reference_on_a_mixed_step_with_padding():
    q, k, v, k_cache, v_cache, meta = _mixed_step(torch.float32)
    ref_kv = (k_cache.clone(), v_cache.clone())
    expected = TorchAttention(DIM**-0.5).forward(q, k, v, ref_kv, meta)
    kv = (k_cache.clone(), v_cache.clone())
    got = CpuAttention(DIM**-0.5).forward(q, k, v, kv, meta)
    assert torch.equal(kv[0], ref_kv[0]) and torch.equal(kv[1], ref_kv[1])
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)
    assert torch.count_nonzero(got[-meta.num_padding :]) == 0


def test_cpu_backend_equals_reference_on_a_pure_decode_step():
    batch = make_batch(LENGTHS, 3, 3, 16, torch.float32)
    ref_kv = (batch.k_cache.clone(), batch.v_cache.clone())
    expected = TorchAttention(0.125).forward(batch.q, batch.k, batch.v, ref_kv, batch.meta())
    kv = (batch.k_cache.clone(), batch.v_cache.clone())
    got = CpuAttention(0.125).forward(batch.q, batch.k, batch.v, kv, batch.meta())
    assert torch.equal(kv[0], ref_kv[0]) and torch.equal(kv[1], ref_kv[1])
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)


def test_cpu_backend_prefill_only_steps_and_kernels_off_equal_the_reference(kernels_off):
    q, k, v, k_cache, v_cache, meta = _mixed_step(torch.float32)
    prefill_only = AttentionMetadata(
        num_decodes=0,
        slot_mapping=meta.slot_mapping[3:],
        block_tables=meta.block_tables[3:],
        seq_lens=meta.seq_lens[3:],
        max_decode_seq_len=0,
        prefill_starts=(0, meta.prefill_query_lens[0]),
        prefill_query_lens=meta.prefill_query_lens,
        prefill_seq_lens=meta.prefill_seq_lens,
        num_padding=meta.num_padding,
    )
    args = (q[3:], k[3:], v[3:])
    ref_kv = (k_cache.clone(), v_cache.clone())
    expected = TorchAttention(DIM**-0.5).forward(*args, ref_kv, prefill_only)
    kv = (k_cache.clone(), v_cache.clone())
    assert torch.equal(CpuAttention(DIM**-0.5).forward(*args, kv, prefill_only), expected)
    kernels_off()  # and any step at all when the kernels are off
    kv = (k_cache.clone(), v_cache.clone())
    ref_kv = (k_cache.clone(), v_cache.clone())
    expected = TorchAttention(DIM**-0.5).forward(q, k, v, ref_kv, meta)
    assert torch.equal(CpuAttention(DIM**-0.5).forward(q, k, v, kv, meta), expected)


def _block_major(k_cache: torch.Tensor, v_cache: torch.Tensor, spare: int = 5):
    """The caches as views of one buffer of slabs, a slab per block holding its keys, its values
    and ``spare`` rows of NaN (Seesaw's block-major device KV: rank_hook.DeviceKV)."""
    n, block = k_cache.shape[0], k_cache[0].numel()
    slabs = torch.full((n, 2 * block + spare * k_cache.shape[-1]), float("nan"))
    slabs = slabs.to(k_cache.dtype)
    k = slabs[:, :block].view(k_cache.shape)
    v = slabs[:, block : 2 * block].view(v_cache.shape)
    k.copy_(k_cache)
    v.copy_(v_cache)
    return slabs, k, v


@pytest.mark.parametrize("threads", [1, 4], indirect=True)
def test_block_strided_caches_give_the_contiguous_results_and_touch_only_their_blocks(threads):
    batch = make_batch(LENGTHS, 3, 3, 4, torch.float32, skip=(2,))
    want_out, want_kc, want_vc = run_kernel(batch, 0.125)
    slabs, kc, vc = _block_major(batch.k_cache, batch.v_cache)
    assert kc.stride(0) > kc[0].numel() and not kc.is_contiguous()
    out = torch.empty(batch.q.shape, dtype=batch.q.dtype)
    kernels.paged_decode_attention(
        out, batch.q, batch.k, batch.v, kc, vc, batch.slots, batch.tables, batch.lens, 0.125
    )
    assert torch.equal(out, want_out) and torch.equal(kc, want_kc) and torch.equal(vc, want_vc)
    assert torch.isnan(slabs[:, 2 * kc[0].numel() :]).all()  # nothing outside the blocks
    _, kc2, vc2 = _block_major(batch.k_cache, batch.v_cache)
    kernels.write_kv(batch.k, batch.v, kc2, vc2, batch.slots)
    assert torch.equal(kc2, want_kc) and torch.equal(vc2, want_vc)


def test_cpu_backend_on_block_strided_caches_equals_the_reference_on_them():
    q, k, v, k_cache, v_cache, meta = _mixed_step(torch.float32)
    _, *ref_kv = _block_major(k_cache, v_cache)
    expected = TorchAttention(DIM**-0.5).forward(q, k, v, (ref_kv[0], ref_kv[1]), meta)
    _, kc, vc = _block_major(k_cache, v_cache)
    got = CpuAttention(DIM**-0.5).forward(q, k, v, (kc, vc), meta)
    assert torch.equal(kc, ref_kv[0]) and torch.equal(vc, ref_kv[1])
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)


def test_a_cache_not_contiguous_inside_its_blocks_is_refused():
    batch = make_batch([9, 4], 2, 1, 4, torch.float32)
    kc = batch.k_cache.transpose(1, 2).contiguous().transpose(1, 2)  # heads strided in a block
    vc = batch.v_cache.transpose(1, 2).contiguous().transpose(1, 2)
    out = torch.empty(batch.q.shape, dtype=batch.q.dtype)
    with pytest.raises(RuntimeError, match="contiguous within each block"):
        kernels.paged_decode_attention(
            out, batch.q, batch.k, batch.v, kc, vc, batch.slots, batch.tables, batch.lens, 0.125
        )
    with pytest.raises(RuntimeError, match="contiguous within each block"):
        kernels.write_kv(batch.k, batch.v, kc, vc, batch.slots)
