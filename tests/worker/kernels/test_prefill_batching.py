"""Prefill chunks without cached history attended as one padded SDPA call, against one by one."""

from __future__ import annotations

import pytest
import torch

from gearshift.worker.attention import metadata
from gearshift.worker.attention.cpu_backend import CpuAttention
from gearshift.worker.attention.metadata import AttentionMetadata, group_prefills
from gearshift.worker.attention.torch_ref import TorchAttention
from tests.worker.helpers import scattered_block_tables

DIM = 32


def test_chunks_of_similar_length_are_grouped_and_long_or_lone_chunks_are_not():
    lengths = {0: 40, 1: 38, 2: 5, 3: 41, 4: 4, 5: 100}
    groups = group_prefills(lengths, 2.0, call_work=1024)
    assert groups == [[5], [3, 0, 1, 2, 4]]
    for group in groups:
        padded = len(group) * max(lengths[i] for i in group) ** 2
        real = sum(lengths[i] ** 2 for i in group)
        assert padded <= min(2.0 * real, real + (len(group) - 1) * 1024)
    # Padding more than doubles the work; or costs more than the calls it saves.
    assert group_prefills({0: 40, 1: 5, 2: 5}, 2.0, call_work=10**6) == [[0, 1], [2]]
    assert group_prefills({0: 1000, 1: 800}, 2.0, call_work=1024) == [[0], [1]]
    assert group_prefills({0: 40, 1: 35}, 2.0, call_work=1024) == [[0, 1]]
    assert group_prefills({}, 2.0) == []


def _step(
    chunks: list[tuple[int, int]], decodes: list[int], padding: int, dtype: torch.dtype, seed: int
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor], AttentionMetadata
]:
    """Decodes, then prefill chunks (history, query length), then padding, over a random cache."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv, bs = 6, 2, 8
    lens = decodes + [h + n for h, n in chunks]
    widths = [-(-n // bs) for n in lens]
    blocks = sum(widths) + 1
    tables = scattered_block_tables(lens, bs, blocks, max(widths), g)

    def slot(b: int, pos: int) -> int:
        return int(tables[b, pos // bs]) * bs + pos % bs

    slots = [slot(b, n - 1) for b, n in enumerate(decodes)]
    starts = []
    for i, (h, n) in enumerate(chunks):
        starts.append(len(slots))
        slots += [slot(len(decodes) + i, p) for p in range(h, h + n)]
    slots += [-1] * padding
    tokens = len(slots)
    meta = AttentionMetadata(
        num_decodes=len(decodes),
        slot_mapping=torch.tensor(slots),
        block_tables=tables,
        seq_lens=torch.tensor(lens),
        max_decode_seq_len=max(decodes, default=0),
        prefill_starts=tuple(starts),
        prefill_query_lens=tuple(n for _, n in chunks),
        prefill_seq_lens=tuple(h + n for h, n in chunks),
        num_padding=padding,
    )
    kv = (
        torch.randn(blocks, hkv, bs, DIM, generator=g).to(dtype),
        torch.randn(blocks, hkv, bs, DIM, generator=g).to(dtype),
    )
    qkv = torch.randn(tokens, (hq + 2 * hkv) * DIM, generator=g).to(dtype)
    q = qkv[:, : hq * DIM].view(tokens, hq, DIM)
    k = qkv[:, hq * DIM : (hq + hkv) * DIM].view(tokens, hkv, DIM)
    v = qkv[:, (hq + hkv) * DIM :].view(tokens, hkv, DIM)
    return q, k, v, kv, meta


def _one_by_one(monkeypatch: pytest.MonkeyPatch, meta: AttentionMetadata) -> AttentionMetadata:
    """A copy of ``meta`` whose plan runs every chunk on its own (the path before batching)."""
    with monkeypatch.context() as m:
        m.setattr(metadata, "MAX_PADDING_WORK", 0.0)
        fresh = AttentionMetadata(
            **{f: getattr(meta, f) for f in AttentionMetadata.__dataclass_fields__}
        )
        plan = fresh.prefill_plan
    assert plan.batches == () and len(plan.singles) == meta.num_prefills
    return fresh


# (history, query length) per chunk: contiguous fresh chunks; fresh chunks around a chunk with
# history (their rows are not one run); two groups of different lengths; one chunk alone.
CASES = {
    "contiguous": ([(0, 37), (0, 41), (0, 33), (0, 40)], [5, 17], 0),
    "around-history": ([(0, 20), (11, 6), (0, 17), (0, 19)], [9], 3),
    "two-groups": ([(0, 64), (0, 9), (0, 60), (0, 7), (0, 8)], [], 2),
    "single": ([(0, 12), (20, 4)], [3], 0),
    "dense": ([(0, 16), (0, 16), (0, 16)], [4, 9], 1),
}
BATCHES = {
    "contiguous": [(1, 3, 0, 2)],
    "around-history": [(0, 3, 2)],
    "two-groups": [(0, 2), (1, 4, 3)],
    "single": [],
    "dense": [(0, 1, 2)],
}


@pytest.mark.parametrize("backend", [TorchAttention, CpuAttention])
@pytest.mark.parametrize("case", sorted(CASES))
def test_padded_prefill_equals_one_by_one_in_fp32(case, backend, monkeypatch):
    chunks, decodes, padding = CASES[case]
    q, k, v, kv, meta = _step(chunks, decodes, padding, torch.float32, seed=len(case))
    plan = meta.prefill_plan
    assert [b.chunks for b in plan.batches] == BATCHES[case]
    batched = {i for b in plan.batches for i in b.chunks}
    assert set(plan.singles) == set(range(len(chunks))) - batched
    # One run of rows (an out= gather), or rows that other chunks interleave (an index_put).
    contiguous = (len(decodes), len(decodes) + sum(n for _, n in chunks))
    one_run = case in ("contiguous", "dense")
    want_ranges = [contiguous] if one_run else [None] * len(BATCHES[case])
    assert [b.row_range for b in plan.batches] == want_ranges
    # Equal chunks back to back: the padded batch is a view of the rows (no gather).
    assert [b.dense for b in plan.batches] == [case == "dense"] * len(BATCHES[case])
    core = backend(DIM**-0.5)
    kv_batched = (kv[0].clone(), kv[1].clone())
    got = core.forward(q, k, v, kv_batched, meta)
    kv_ref = (kv[0].clone(), kv[1].clone())
    want = core.forward(q, k, v, kv_ref, _one_by_one(monkeypatch, meta))
    assert torch.equal(kv_batched[0], kv_ref[0]) and torch.equal(kv_batched[1], kv_ref[1])
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    if padding:
        assert torch.count_nonzero(got[-padding:]) == 0


def test_padded_prefill_in_bf16_is_within_rounding_of_one_by_one(monkeypatch):
    chunks, decodes, padding = CASES["contiguous"]
    q, k, v, kv, meta = _step(chunks, decodes, padding, torch.bfloat16, seed=3)
    core = TorchAttention(DIM**-0.5)
    got = core.forward(q, k, v, (kv[0].clone(), kv[1].clone()), meta)
    want = core.forward(q, k, v, (kv[0].clone(), kv[1].clone()), _one_by_one(monkeypatch, meta))
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_the_plan_is_built_once_per_step():
    *_, meta = _step(CASES["contiguous"][0], [], 0, torch.float32, seed=0)
    assert meta.prefill_plan is meta.prefill_plan
