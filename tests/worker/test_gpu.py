"""The engine on one CUDA device (marked gpu: skipped without one).

The same weights through the CPU engine are the reference: fp32 logits of every step of a mixed
prefill/decode batch agree, the KV cache is sized from free device memory, and every block is
returned.
"""

from __future__ import annotations

import pytest
import torch

from gearshift.worker.sampling.params import SamplingParams
from tests.worker.helpers import run_recording

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_cuda_engine_logits_equal_the_cpu_engine(tiny_checkpoint, engine_factory):
    folder = tiny_checkpoint("qwen3")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (3, 17, 40)]
    # Two requests at once, a third joining mid-generation: prefills and decodes share steps.
    requests = {
        0: [("a", prompts[0], GREEDY), ("b", prompts[1], GREEDY)],
        2: [("c", prompts[2], GREEDY)],
    }
    cpu = run_recording(engine_factory(folder, skip_tokenizer_init=True), requests)
    engine = engine_factory(
        folder,
        skip_tokenizer_init=True,
        device="cuda",
        gpu_memory_utilization=0.2,
        attention_backend="torch",
    )
    assert engine.blocks.num_blocks > 0  # sized from free device memory, not kv_cache_bytes
    gpu = run_recording(engine, requests)
    assert gpu.keys() == cpu.keys()
    for rid, rows in cpu.items():
        assert [ctx for ctx, _ in gpu[rid]] == [ctx for ctx, _ in rows]  # same greedy tokens
        for (_, want), (_, got) in zip(rows, gpu[rid], strict=True):
            torch.testing.assert_close(got.float().cpu(), want.float(), atol=2e-4, rtol=2e-4)
