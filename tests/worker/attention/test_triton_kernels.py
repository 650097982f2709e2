"""The triton backend's kernels under Triton's interpreter (CPU tensors) against the torch
reference, fp32: mixed batches of decodes and prefill chunks with cached prefixes, split-K decode,
padding, the lse rows of ``forward_lse`` and the KV write (pages compared exactly).

Tolerance: atol 1e-5, rtol 1e-4. Both sides compute in fp32 from the same inputs; they differ
only in summation order (online softmax over key tiles in base 2, split merges) against one
explicit softmax, which moves results by a few fp32 ulps of values of order 1 (the largest error
seen here is about 1e-6). A wrong mask, page or head mapping is off by order 0.1.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from gearshift.worker.attention.metadata import AttentionMetadata
from gearshift.worker.attention.torch_ref import TorchAttention
from gearshift.worker.attention.triton_backend import TritonAttention
from tests.worker.attention.triton_batches import Batch, make_batch

pytest.importorskip("triton")

ATOL, RTOL = 1e-5, 1e-4


pytestmark = pytest.mark.usefixtures("interpreter")


def _reference(batch: Batch, scale: float) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    kv = batch.kv()
    out, lse = TorchAttention(scale).forward_lse(batch.q, batch.k, batch.v, kv, batch.meta)
    return out, lse, kv


def _assert_matches_reference(batch: Batch) -> TritonAttention:
    scale = batch.q.shape[-1] ** -0.5
    want, want_lse, want_kv = _reference(batch, scale)
    core = TritonAttention(scale)
    kv = batch.kv()
    out, lse = core.forward_lse(batch.q, batch.k, batch.v, kv, batch.meta)
    assert lse.dtype == torch.float32 and lse.shape == batch.q.shape[:2]
    torch.testing.assert_close(out, want, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(lse, want_lse, atol=ATOL, rtol=RTOL)  # -inf rows equal too
    assert torch.equal(kv[0], want_kv[0]) and torch.equal(kv[1], want_kv[1])
    return core


# Every head dim x GQA ratio once (9 cases), the block size chosen so that every head dim and
# every ratio also meets both block sizes (a covering design, not the full 18-case product). The
# interpreter takes seconds a case: three (every head dim, ratio and block size among them) run
# in the quick loop, the rest are slow.
SLOW = pytest.mark.slow
MATRIX = [
    (32, 1, 16),
    pytest.param(32, 3, 64, marks=SLOW),
    pytest.param(32, 8, 16, marks=SLOW),
    pytest.param(64, 1, 64, marks=SLOW),
    pytest.param(64, 3, 16, marks=SLOW),
    (64, 8, 64),
    pytest.param(128, 1, 16, marks=SLOW),
    (128, 3, 64),
    pytest.param(128, 8, 64, marks=SLOW),
]


@pytest.mark.parametrize(("head_dim", "group", "block_size"), MATRIX)
def test_mixed_batch_with_cached_prefixes_matches_torch(head_dim, group, block_size):
    # A decode long enough for two KV splits (300 keys in a table of 304 or 320: ranges of >= 256
    # per the policy), a short one, a chunk after a cached prefix, a fresh chunk, a chunk whose
    # prefix ends mid-block, then padding; no length is a multiple of the block size.
    batch = make_batch(
        [300, 37],
        [(20, 33), (9, 9), (5, 70)],
        kv_heads=2,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        padding=3,
        seed=head_dim + group + block_size,
    )
    _assert_matches_reference(batch)


def test_forward_is_forward_lse_without_the_lse():
    batch = make_batch([50], [(7, 20)], kv_heads=1, group=2, head_dim=32, block_size=16, padding=1)
    scale = 32**-0.5
    out = TritonAttention(scale).forward(batch.q, batch.k, batch.v, batch.kv(), batch.meta)
    want, _ = TritonAttention(scale).forward_lse(batch.q, batch.k, batch.v, batch.kv(), batch.meta)
    assert torch.equal(out, want)


@pytest.mark.slow
def test_prefill_chunks_across_query_tiles_and_the_causal_edge():
    # 100 rows cross the 64-row query tiles, and their prefix (47) puts the causal edge in the
    # middle of key tiles; a second chunk of more than one tile has no history.
    batch = make_batch(
        [], [(100, 147), (70, 70)], kv_heads=1, group=2, head_dim=32, block_size=16, seed=7
    )
    _assert_matches_reference(batch)


def test_decode_only_step_with_padding_and_a_wide_table_matches_torch():
    # As a CUDA graph bucket pads it: padding tokens after the decodes and a block table wider
    # than any context.
    batch = make_batch(
        [5, 130, 17, 64],
        [],
        kv_heads=2,
        group=4,
        head_dim=64,
        block_size=16,
        padding=4,
        spare_width=30,
        seed=3,
    )
    _assert_matches_reference(batch)


@pytest.mark.parametrize("splits", [1, 3, pytest.param(7, marks=SLOW)])
def test_decode_splits_merge_into_one_softmax(splits):
    # More ranges than a short context has tiles (empty ranges), uneven ranges, and one range.
    from gearshift.worker.attention.triton import decode

    batch = make_batch(
        [3, 200, 129, 520], [], kv_heads=2, group=4, head_dim=64, block_size=16, seed=splits
    )
    scale = 64**-0.5
    want, want_lse, kv = _reference(batch, scale)  # writes this step's KV into kv
    out = torch.empty_like(batch.q)
    lse = torch.empty(batch.q.shape[:2])
    meta = batch.meta
    decode.paged_decode(
        batch.q, *kv, meta.block_tables, meta.seq_lens, out, lse, scale, splits
    )  # fmt: skip
    torch.testing.assert_close(out, want, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(lse, want_lse, atol=ATOL, rtol=RTOL)


def test_a_decode_row_of_length_zero_comes_out_zero_with_lse_minus_inf():
    # How a CUDA graph bucket may pad: decode rows with seq_lens 0 and slot -1.
    batch = make_batch([40, 90], [], kv_heads=1, group=3, head_dim=32, block_size=16, seed=4)
    meta = batch.meta
    lens = meta.seq_lens.clone()
    lens[1] = 0
    slots = meta.slot_mapping.clone()
    slots[1] = -1
    padded = replace(meta, seq_lens=lens, slot_mapping=slots)
    kv = batch.kv()
    out, lse = TritonAttention(32**-0.5).forward_lse(batch.q, batch.k, batch.v, kv, padded)
    assert not out[1].any() and bool((lse[1] == float("-inf")).all())
    single = AttentionMetadata(
        num_decodes=1,
        slot_mapping=slots[:1],
        block_tables=meta.block_tables[:1],
        seq_lens=lens[:1],
        max_decode_seq_len=40,
        prefill_starts=(),
        prefill_query_lens=(),
        prefill_seq_lens=(),
    )
    ref_kv = batch.kv()
    want, want_lse = TorchAttention(32**-0.5).forward_lse(
        batch.q[:1], batch.k[:1], batch.v[:1], ref_kv, single
    )
    torch.testing.assert_close(out[:1], want, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(lse[:1], want_lse, atol=ATOL, rtol=RTOL)
    # Row 1's slot is -1: the cache is the reference's, which wrote row 0's slot only.
    assert torch.equal(kv[0], ref_kv[0]) and torch.equal(kv[1], ref_kv[1])


def test_kv_write_stores_exactly_the_reference_pages_and_padding_writes_nothing():
    from gearshift.worker.attention.torch_ref import write_kv as reference_write
    from gearshift.worker.attention.triton.kv_write import write_kv

    batch = make_batch(
        [9, 64], [(30, 47)], kv_heads=3, group=1, head_dim=64, block_size=16, padding=5, seed=9
    )
    # k as the model hands it over: a view into a fused q/k tensor (rows strided by q's heads).
    fused = torch.cat((batch.q, batch.k), dim=1)
    k = fused[:, batch.q.shape[1] :]
    assert not k.is_contiguous()
    want = batch.kv()
    reference_write(want, k, batch.v, batch.meta.slot_mapping)
    got = batch.kv()
    write_kv(k, batch.v, *got, batch.meta.slot_mapping)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    untouched = batch.kv()
    write_kv(k, batch.v, *untouched, torch.full_like(batch.meta.slot_mapping, -1))
    assert torch.equal(untouched[0], batch.k_cache) and torch.equal(untouched[1], batch.v_cache)


def test_split_count_is_a_function_of_static_sizes():
    from gearshift.worker.attention.triton.decode import MAX_SPLITS, num_splits

    # Short tables: one range; long ones: a range per 256 keys, up to MAX_SPLITS.
    assert num_splits(1, 8, 4, 16, 132) == 1
    assert num_splits(1, 8, 64, 16, 132) == 4
    assert num_splits(1, 8, 4096, 16, 132) == MAX_SPLITS
    # Big batches fill the GPU without splitting: 64 x 8 programs outnumber 132 SMs twice over.
    assert num_splits(64, 8, 4096, 16, 132) == 1
    assert num_splits(8, 8, 4096, 16, 132) == 5


def test_strided_views_of_a_fused_projection_are_read_in_place():
    # As the model and Ulysses hand them over: q/k/v as column slices of one fused [T, H, D]
    # tensor (rows strided by every head), not contiguous copies.
    batch = make_batch(
        [45], [(12, 30)], kv_heads=2, group=2, head_dim=32, block_size=16, padding=1, seed=12
    )
    fused = torch.cat((batch.q, batch.k, batch.v), dim=1)
    heads = batch.q.shape[1]
    q, k, v = fused[:, :heads], fused[:, heads : heads + 2], fused[:, heads + 2 :]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    strided = Batch(q, k, v, batch.meta, batch.k_cache, batch.v_cache)
    _assert_matches_reference(strided)


@pytest.mark.parametrize("block_size", [1, 48, 128])
def test_any_block_size_the_engine_allows(block_size):
    # EngineConfig takes any positive block size: pages of one token, pages that do not divide
    # the 64-key tiles, and pages longer than a tile.
    batch = make_batch(
        [150, 9], [(11, 140)], kv_heads=2, group=2, head_dim=32, block_size=block_size, seed=5
    )
    _assert_matches_reference(batch)


def test_block_strided_caches_give_the_results_of_contiguous_ones():
    """Seesaw's block-major device KV (rank_hook.DeviceKV): a layer's blocks are a slab apart,
    with the other layers' data between them; the kernels take the block stride."""
    batch = make_batch(
        [9, 40], [(12, 21)], kv_heads=2, group=3, head_dim=32, block_size=16, padding=2, seed=5
    )
    scale = 32**-0.5
    want_kv = batch.kv()
    want, want_lse = TritonAttention(scale).forward_lse(
        batch.q, batch.k, batch.v, want_kv, batch.meta
    )
    n, block = batch.k_cache.shape[0], batch.k_cache[0].numel()
    slabs = torch.full((n, 3 * block), float("nan"))  # keys, values, another layer's data
    kc = slabs[:, :block].view(batch.k_cache.shape)
    vc = slabs[:, block : 2 * block].view(batch.v_cache.shape)
    kc.copy_(batch.k_cache)
    vc.copy_(batch.v_cache)
    assert kc.stride(0) == 3 * block
    out, lse = TritonAttention(scale).forward_lse(batch.q, batch.k, batch.v, (kc, vc), batch.meta)
    assert torch.equal(kc, want_kv[0]) and torch.equal(vc, want_kv[1])
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)
    assert torch.isnan(slabs[:, 2 * block :]).all()
