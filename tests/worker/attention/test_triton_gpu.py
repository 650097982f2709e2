"""The triton backend on a CUDA device (marked gpu: skipped without one): its kernels against the
torch reference at serving shapes in bf16, a decode step captured in a CUDA graph and replayed
for other lengths, and the engine's greedy tokens equal to the torch backend's.

bf16 tolerance: the reference attends in fp32 over the same bf16 values; the kernels round the
softmax weights to bf16 before P·V (as FlashAttention does) and write bf16, about 2^-8 relative,
so outputs of magnitude <= ~1 differ by up to ~1e-2. A wrong key, mask or head is off by far more.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from gearshift.worker.attention.torch_ref import TorchAttention
from gearshift.worker.attention.triton_backend import TritonAttention
from gearshift.worker.sampling.params import SamplingParams
from tests.worker.attention.triton_batches import Batch, make_batch
from tests.worker.helpers import run_recording

pytestmark = pytest.mark.gpu

BF16_TOL = {"atol": 2e-2, "rtol": 2e-2}
LSE_TOL = {"atol": 1e-2, "rtol": 1e-3}


def _against_fp32_reference(batch: Batch) -> None:
    scale = batch.q.shape[-1] ** -0.5
    kv = batch.kv()
    out, lse = TritonAttention(scale).forward_lse(batch.q, batch.k, batch.v, kv, batch.meta)
    ref_kv = (batch.k_cache.float(), batch.v_cache.float())
    want, want_lse = TorchAttention(scale).forward_lse(
        batch.q.float(), batch.k.float(), batch.v.float(), ref_kv, batch.meta
    )
    torch.testing.assert_close(out.float(), want, **BF16_TOL)
    torch.testing.assert_close(lse, want_lse, **LSE_TOL)
    # The KV write stores the same bf16 values the reference stored (upcast).
    assert torch.equal(kv[0].float(), ref_kv[0]) and torch.equal(kv[1].float(), ref_kv[1])


@pytest.mark.parametrize(("q_heads", "kv_heads"), [(32, 8), (32, 4)])
def test_batch_of_64_decodes_up_to_8k_keys_in_bf16(q_heads, kv_heads):
    g = torch.Generator().manual_seed(q_heads + kv_heads)
    lens = torch.randint(1, 8192, (64,), generator=g).tolist()
    lens[0], lens[1] = 8192, 1  # the longest and the shortest context
    batch = make_batch(
        lens, [], kv_heads=kv_heads, group=q_heads // kv_heads, head_dim=128, block_size=16,
        dtype=torch.bfloat16, device="cuda", spare_blocks=0,
    )  # fmt: skip
    _against_fp32_reference(batch)


@pytest.mark.parametrize(("q_heads", "kv_heads"), [(32, 8), (32, 4)])
def test_2k_prefill_chunks_with_cached_prefixes_beside_decodes_in_bf16(q_heads, kv_heads):
    batch = make_batch(
        [4000, 17, 1025],
        [(2048, 5000), (2048, 2048), (1500, 1700)],
        kv_heads=kv_heads, group=q_heads // kv_heads, head_dim=128, block_size=16,
        padding=5, dtype=torch.bfloat16, device="cuda",
    )  # fmt: skip
    _against_fp32_reference(batch)


def test_a_decode_step_captured_in_a_cuda_graph_replays_for_other_lengths():
    # The bucket: 8 decode rows and 2 padding tokens over a 512-block table (8k keys), and a
    # cache of 2000 blocks.
    def bucket(seed: int, lens: list[int]) -> Batch:
        used = [-(-n // 16) for n in lens]
        return make_batch(
            lens, [], kv_heads=8, group=4, head_dim=128, block_size=16, padding=2, seed=seed,
            spare_width=512 - max(used), spare_blocks=2000 - sum(used),
            dtype=torch.bfloat16, device="cuda",
        )  # fmt: skip

    first = bucket(0, [100, 5000, 17, 8000, 1, 64, 300, 2048])
    core = TritonAttention(128**-0.5)
    kv = first.kv()
    meta = first.meta
    static_q, static_k, static_v = first.q.clone(), first.k.clone(), first.v.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        core.forward_lse(static_q, static_k, static_v, first.kv(), meta)  # compiles the kernels
        torch.cuda.set_sync_debug_mode("error")  # any host sync in a decode step raises
        try:
            core.forward_lse(static_q, static_k, static_v, first.kv(), meta)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_lse = core.forward_lse(static_q, static_k, static_v, kv, meta)
    # Other lengths (one of them a padding row of length 0), other blocks, another cache.
    second = bucket(1, [7000, 3, 129, 4096, 8100, 2, 640, 33])
    lens = second.meta.seq_lens.clone()
    lens[5] = 0
    slots = second.meta.slot_mapping.clone()
    slots[5] = -1
    new_meta = replace(second.meta, seq_lens=lens, slot_mapping=slots)
    for static, new in (
        (meta.seq_lens, lens),
        (meta.slot_mapping, slots),
        (meta.block_tables, new_meta.block_tables),
        (static_q, second.q),
        (static_k, second.k),
        (static_v, second.v),
        (kv[0], second.k_cache),
        (kv[1], second.v_cache),
    ):
        static.copy_(new)
    graph.replay()
    eager_kv = second.kv()
    want, want_lse = core.forward_lse(second.q, second.k, second.v, eager_kv, new_meta)
    torch.cuda.synchronize()
    assert torch.equal(static_out, want) and torch.equal(static_lse, want_lse)
    assert torch.equal(kv[0], eager_kv[0]) and torch.equal(kv[1], eager_kv[1])
    assert not static_out[5].any() and bool((static_lse[5] == float("-inf")).all())


def test_engine_greedy_tokens_with_triton_equal_torch_on_cuda(tiny_checkpoint, engine_factory):
    folder = tiny_checkpoint("qwen3")  # GQA 4:1 at head_dim 32
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (3, 17, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    requests = {
        0: [("a", prompts[0], params), ("b", prompts[1], params)],
        2: [("c", prompts[2], params)],
    }
    kw = {
        "skip_tokenizer_init": True,
        "device": "cuda",
        "gpu_memory_utilization": 0.2,
        "max_num_batched_tokens": 16,  # chunked prefills over cached prefixes beside decodes
    }
    triton_engine = engine_factory(folder, attention_backend="triton", **kw)
    assert all(
        isinstance(gear.core, TritonAttention) for gear in triton_engine.executor.inner.gears
    )
    got = run_recording(triton_engine, requests)
    want = run_recording(engine_factory(folder, attention_backend="torch", **kw), requests)
    assert got.keys() == want.keys()
    for rid, rows in want.items():
        assert [ctx for ctx, _ in got[rid]] == [ctx for ctx, _ in rows], rid
        for (_, a), (_, b) in zip(got[rid], rows, strict=True):
            torch.testing.assert_close(a.float().cpu(), b.float().cpu(), atol=2e-4, rtol=2e-4)
