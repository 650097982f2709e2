"""The engine on the triton backend (Triton's interpreter, CPU, fp32) gives the torch backend's
greedy tokens and logits, step for step, with chunked prefills over cached prefixes mixed with
decodes."""

from __future__ import annotations

import pytest
import torch

from gearshift.worker.attention.triton_backend import TritonAttention
from gearshift.worker.sampling.params import SamplingParams
from tests.worker.helpers import run_recording

pytest.importorskip("triton")


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [16, 64])
def test_tiny_model_greedy_tokens_and_logits_equal_the_torch_backend(
    block_size, tiny_checkpoint, engine_factory, interpreter
):
    folder = tiny_checkpoint("qwen3")  # q/k norm, GQA 4:1 at head_dim 32
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (37, 3, 70)]
    # 16 tokens a step: the long prompts prefill in chunks over their cached prefix while the
    # others decode; the third arrives mid-generation.
    requests = {
        0: [("a", prompts[0], params), ("b", prompts[1], params)],
        3: [("c", prompts[2], params)],
    }
    kw = {"skip_tokenizer_init": True, "block_size": block_size, "max_num_batched_tokens": 16}
    triton_engine = engine_factory(folder, attention_backend="triton", **kw)
    gears = triton_engine.executor.inner.gears
    assert all(isinstance(gear.core, TritonAttention) for gear in gears)
    got = run_recording(triton_engine, requests)
    want = run_recording(engine_factory(folder, attention_backend="torch", **kw), requests)
    assert got.keys() == want.keys()
    for rid, rows in want.items():
        assert [ctx for ctx, _ in got[rid]] == [ctx for ctx, _ in rows], rid
        for (_, a), (_, b) in zip(got[rid], rows, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
