"""The attention interface's log-sum-exp: forward_lse gives forward's output plus each row's LSE,
and attention over disjoint pieces of a context merges into attention over all of it."""

from __future__ import annotations

import pytest
import torch

from gearshift.worker.attention.core import attention_lse, merge_partials
from gearshift.worker.attention.metadata import AttentionMetadata
from gearshift.worker.attention.torch_ref import TorchAttention

HQ, HKV, D, BS = 6, 2, 16, 4


def _batch(g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """One decode (context 9: 8 cached + 1 new) and one prefill chunk of 5 after 6 cached."""
    nb = 16
    k_cache = torch.randn(nb, HKV, BS, D, generator=g)
    v_cache = torch.randn(nb, HKV, BS, D, generator=g)
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 0]])
    q = torch.randn(6, HQ, D, generator=g)
    k = torch.randn(6, HKV, D, generator=g)
    v = torch.randn(6, HKV, D, generator=g)
    # Slots: decode at position 8 (block 1 of its table -> 1*4 + 0), chunk at positions 6..10.
    slots = [1 * BS + 0] + [int(tables[1, p // BS]) * BS + p % BS for p in range(6, 11)]
    return k_cache, v_cache, tables, q, k, v, torch.tensor(slots)


def _meta(tables: torch.Tensor, slots: torch.Tensor) -> AttentionMetadata:
    return AttentionMetadata(
        num_decodes=1,
        slot_mapping=slots,
        block_tables=tables,
        seq_lens=torch.tensor([9, 11]),
        max_decode_seq_len=9,
        prefill_starts=(1,),
        prefill_query_lens=(5,),
        prefill_seq_lens=(11,),
    )


def test_forward_lse_matches_forward_and_a_brute_force_logsumexp():
    g = torch.Generator().manual_seed(0)
    k_cache, v_cache, tables, q, k, v, slots = _batch(g)
    core = TorchAttention(D**-0.5)
    meta = _meta(tables, slots)
    want = core.forward(q, k, v, (k_cache.clone(), v_cache.clone()), meta)
    kv = (k_cache.clone(), v_cache.clone())
    out, lse = core.forward_lse(q, k, v, kv, meta)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert lse.shape == (6, HQ) and lse.dtype == torch.float32
    # The decode row: its query against all 9 keys of its context, by hand.
    keys = kv[0][tables[0]].transpose(0, 1).reshape(HKV, -1, D)[:, :9]
    scores = torch.einsum("hd,hld->hl", q[0], keys.repeat_interleave(HQ // HKV, 0)) * D**-0.5
    torch.testing.assert_close(lse[0], torch.logsumexp(scores, -1), atol=1e-5, rtol=1e-5)


def test_attention_over_two_halves_of_a_context_merges_into_the_whole():
    g = torch.Generator().manual_seed(1)
    n, length = 3, 20
    q = torch.randn(n, HQ, D, generator=g)
    keys = torch.randn(HQ, length, D, generator=g)
    values = torch.randn(HQ, length, D, generator=g)

    def attend(lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.einsum("nhd,hld->nhl", q, keys[:, lo:hi]) * D**-0.5
        lse = torch.logsumexp(scores, -1)
        out = torch.einsum("nhl,hld->nhd", torch.softmax(scores, -1), values[:, lo:hi])
        return out, lse

    whole_out, whole_lse = attend(0, length)
    parts = [attend(0, 7), attend(7, length)]
    out, lse = merge_partials([p[0] for p in parts], [p[1] for p in parts])
    torch.testing.assert_close(out, whole_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, whole_lse, atol=1e-5, rtol=1e-5)
    # A part that saw no key (lse -inf) changes nothing.
    empty = (torch.zeros_like(whole_out), torch.full_like(whole_lse, float("-inf")))
    out2, lse2 = merge_partials([whole_out, empty[0]], [whole_lse, empty[1]])
    torch.testing.assert_close(out2, whole_out)
    torch.testing.assert_close(lse2, whole_lse)


def test_attention_lse_aligns_causal_queries_to_the_block_end_with_gqa():
    g = torch.Generator().manual_seed(2)
    n, length = 3, 7
    q = torch.randn(n, HQ, D, generator=g, dtype=torch.float64)
    k = torch.randn(length, HKV, D, generator=g, dtype=torch.float64)
    v = torch.randn(length, HKV, D, generator=g, dtype=torch.float64)
    keys = k.repeat_interleave(HQ // HKV, dim=1)  # query head h reads KV head h // group
    values = v.repeat_interleave(HQ // HKV, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, keys) * D**-0.5
    for causal in (False, True):
        s = scores.clone()
        if causal:  # query i sits at position length - n + i
            s.masked_fill_(
                torch.arange(length)[None] > (length - n + torch.arange(n))[:, None], float("-inf")
            )
        want_lse = torch.logsumexp(s, -1).transpose(0, 1)
        want = torch.einsum("hnl,lhd->nhd", torch.softmax(s, -1), values)
        out, lse = attention_lse(q.float(), k.float(), v.float(), D**-0.5, causal)
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    # An empty block: zeros and -inf, never NaN.
    out, lse = attention_lse(q.float(), k[:0].float(), v[:0].float(), D**-0.5, False)
    assert not out.any() and bool(torch.isinf(lse).all())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rows_per_tile", [1, 3, 7])
def test_attention_lse_in_row_tiles_equals_one_block(causal, rows_per_tile):
    # A block whose scores exceed the budget runs in tiles of rows (a causal tile with only the
    # keys up to its last row); the result is the one-block result, tile edges included.
    g = torch.Generator().manual_seed(3)
    n, length = 11, 16
    q = torch.randn(n, HQ, D, generator=g)
    k = torch.randn(length, HKV, D, generator=g)
    v = torch.randn(length, HKV, D, generator=g)
    whole, whole_lse = attention_lse(q, k, v, D**-0.5, causal)
    budget = rows_per_tile * HQ * length  # exactly rows_per_tile rows fit
    tiled, tiled_lse = attention_lse(q, k, v, D**-0.5, causal, max_scores=budget)
    torch.testing.assert_close(tiled, whole, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(tiled_lse, whole_lse, atol=1e-6, rtol=1e-5)
