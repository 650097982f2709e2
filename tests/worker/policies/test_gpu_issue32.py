"""Issue 32's GPU paths on one GPU (marked gpu: skipped without one).

- SiDP WaS's device-side prefetcher: a whole pass (copies on the side stream, waits on events)
  captured as a CUDA graph replays the eager pass's FFN outputs: no host wait is left in it.
- Tetris 2 prefill + 1 decode instances sharing the GPU over gloo: one process's greedy tokens.
- Seesaw on the GPU: the host KV store is page-locked (cudaHostRegister), the start-up peak
  counted by the engine's ledger is one shard plus the KV cache, and torch's allocator agrees;
  the greedy text equals one process's.

One GPU cannot run NCCL between ranks (NCCL refuses two ranks on one device): the NCCL tests are
tests/worker/p2p/test_p2p_nccl.py, which need two GPUs.
"""

from __future__ import annotations

import pytest
import torch

from gearshift.worker.policies.sidp.device_prefetch import DevicePrefetch
from gearshift.worker.policies.sidp.ffn import run_ffn
from gearshift.worker.policies.sidp.shared_weights import FfnLayout
from gearshift.worker.sampling.params import SamplingParams

pytestmark = pytest.mark.gpu


def _wasp_pass(prefetch: DevicePrefetch, x: torch.Tensor, remote: set[int], out: torch.Tensor):
    for layer in range(prefetch.num_layers):
        prefetch.begin_layer(layer)
        if layer in remote:
            out[layer].copy_(run_ffn(x, prefetch.acquire(layer)))
            prefetch.release(layer)


def test_a_was_pass_on_the_device_side_prefetcher_captures_as_a_cuda_graph():
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    layout = FfnLayout(hidden=256, inter=512, bias=True)
    g = torch.Generator(device=device).manual_seed(0)
    remote = {1, 2, 4}
    sources = {
        layer: torch.randn(layout.numel, device=device, generator=g) * 0.02 for layer in remote
    }
    prefetch = DevicePrefetch(
        layout=layout,
        num_layers=5,
        order=[1, 2, 4],
        cycle_start={0: 0, 1: 0, 2: 2, 3: 2, 4: 4},
        sources=sources,
        slots=2,
        prefetch_depth=2,
        peak_shifting=False,
        device=device,
    )
    x = torch.randn(16, layout.hidden, device=device, generator=g)
    want = {layer: run_ffn(x, layout.views(sources[layer])) for layer in remote}
    out = torch.zeros(5, 16, layout.hidden, device=device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up passes off the default stream, as capture needs
        _wasp_pass(prefetch, x, remote, out)
        _wasp_pass(prefetch, x, remote, out)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _wasp_pass(prefetch, x, remote, out)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize(device)
        for layer in remote:
            torch.testing.assert_close(out[layer], want[layer])
    prefetch.close()


def test_seesaw_on_one_gpu_pins_its_store_and_starts_with_one_shard(
    tiny_checkpoint, group_factory, engine_factory
):
    from gearshift.worker.engine.device_memory import storage_bytes
    from tests.worker.policies.test_seesaw import ENGINE, _model, _prompts, _seesaw

    gpu = {"device": "cuda:0", "attention_backend": "torch"}
    folder = _model(tiny_checkpoint)
    prompts = _prompts(6)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ref = engine_factory(folder, record=False, kv_cache_bytes=64 << 20, **ENGINE, **gpu)
    want = [o.token_ids for o in ref.generate(prompts, params)]
    torch.cuda.reset_peak_memory_stats(0)
    policy = _seesaw({"tp": 1, "pp": 2}, {"tp": 2, "pp": 1}, asyncSwap=True)
    engine = group_factory(folder, policy, kv_cache_bytes=24 * 1024, **ENGINE, **gpu)
    seesaw = engine.policy
    store = seesaw.hook.store
    assert store.pinned and store.pages.is_pinned()
    weights, device = seesaw.weights, seesaw.weights.working.device
    shard, kv = max(weights.gear_bytes), storage_bytes([seesaw.hook.kv.buffer], device)
    tables = sum(storage_bytes(m.buffers(), device) for m in weights.models)
    assert seesaw.ledger.peak <= shard + kv + tables
    assert [o.token_ids for o in engine.generate(prompts, params)] == want


def test_tetris_two_prefill_one_decode_on_one_gpu_gives_one_process_tokens(tiny_checkpoint):
    """Three ranks sharing GPU 0 over gloo (device tensors through host memory in p2p): the
    pool's KV on the device, ring steps through the core's forward_lse, the hand-off on its slot
    channels; greedy tokens equal one process on the same GPU."""
    from gearshift.worker.config import EngineConfig
    from gearshift.worker.launch import start_engine
    from gearshift.worker.launch.group_config import GroupConfig
    from gearshift.worker.launch.tetris.start import start_tetris
    from gearshift.worker.policies.registry import make_policy
    from tests.worker.policies.tetris.test_tetris_group import (
        ENGINE,
        TIMEOUT_S,
        Outputs,
        _greedy,
        _plan,
        _prompts,
    )

    gpu = {"device": "cuda:0", "attention_backend": "torch"}
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=2)
    prompts = _prompts([37, 23, 30])
    ref = start_engine(EngineConfig(model=str(folder), **{**ENGINE, **gpu}))
    try:
        want = [o.token_ids for o in ref.generate(prompts, _greedy(6))]
    finally:
        ref.shutdown()
    config = EngineConfig(model=str(folder), **{**ENGINE, "kv_cache_bytes": 64 << 20, **gpu})
    policy = make_policy(
        {"tetris": {"prefill_instances": 2, "decode_instances": 1, "transfer_backends": 1}}
    )
    outputs = Outputs()
    group = start_tetris(config, policy, GroupConfig(timeout_s=TIMEOUT_S), outputs)  # type: ignore[arg-type]
    try:
        plans = [_plan([(16, [0]), (21, [0, 1])]), _plan([(23, [1])]), None]
        for i, (ids, plan) in enumerate(zip(prompts, plans, strict=True)):
            group.submit(f"r{i}", ids, _greedy(6), plan)
        got = outputs.collect({f"r{i}" for i in range(3)})
        assert [got[f"r{i}"] for i in range(3)] == want
    finally:
        reports = group.shutdown()
    assert reports and all(r["leaked_blocks"] == 0 for r in reports), reports
