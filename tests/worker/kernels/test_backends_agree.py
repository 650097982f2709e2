"""The C++ CPU path and the torch reference path produce the same model outputs end to end."""

from __future__ import annotations

import pytest
import torch

from gearshift.worker.attention.cpu_backend import CpuAttention
from gearshift.worker.attention.select import make_attention
from gearshift.worker.attention.torch_ref import TorchAttention
from gearshift.worker.config import EngineConfig
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.sampling.params import SamplingParams
from tests.worker.helpers import run_recording


def test_backend_choice_follows_the_config(cpu_kernels):
    assert isinstance(make_attention(EngineConfig(model="m"), 64), CpuAttention)
    assert isinstance(
        make_attention(EngineConfig(model="m", attention_backend="cpu"), 64), CpuAttention
    )
    torch_core = make_attention(EngineConfig(model="m", attention_backend="torch"), 64)
    assert isinstance(torch_core, TorchAttention)
    # auto on CUDA: Triton's kernels (tests/worker/attention/test_triton_select.py).
    cuda_core = make_attention(
        EngineConfig(model="m", device="cuda", attention_backend="torch"), 64
    )
    assert isinstance(cuda_core, TorchAttention)
    with pytest.raises(InvalidRequestError, match="needs device=cpu"):
        make_attention(EngineConfig(model="m", device="cuda", attention_backend="cpu"), 64)
    with pytest.raises(InvalidRequestError, match="attention_backend"):
        EngineConfig(model="m", attention_backend="flash")


@pytest.mark.slow
def test_tiny_model_logits_agree_across_backends_in_mixed_steps(
    cpu_kernels, kernels_off, tiny_checkpoint, engine_factory
):
    folder = tiny_checkpoint("qwen3")  # q/k norm, GQA 4:1 at head_dim 32
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (19, 3, 33)]
    requests = {
        0: [("a", prompts[0], params), ("b", prompts[1], params)],
        3: [("c", prompts[2], params)],
    }
    kw = {"skip_tokenizer_init": True, "block_size": 4, "max_num_batched_tokens": 16}
    fast = run_recording(engine_factory(folder, attention_backend="cpu", **kw), requests)
    kernels_off()
    reference = run_recording(engine_factory(folder, attention_backend="torch", **kw), requests)
    assert fast.keys() == reference.keys()
    for rid, rows in fast.items():
        assert [c for c, _ in rows] == [c for c, _ in reference[rid]], rid
        for (_, a), (_, b) in zip(rows, reference[rid], strict=True):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


@pytest.mark.slow
def test_smollm2_greedy_tokens_are_identical_with_either_backend(
    cpu_kernels, kernels_off, smollm2_path, engine_factory
):
    chats = ["What is the capital of France?", "Write a haiku about the sea.", "Count to ten."]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    fast_engine = engine_factory(
        smollm2_path, record=False, max_model_len=256, attention_backend="cpu"
    )
    prompts = [
        fast_engine.tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in chats
    ]
    fast = fast_engine.generate(prompts, params)
    kernels_off()
    ref_engine = engine_factory(
        smollm2_path, record=False, max_model_len=256, attention_backend="torch"
    )
    reference = ref_engine.generate(prompts, params)
    assert [o.token_ids for o in fast] == [o.token_ids for o in reference]
