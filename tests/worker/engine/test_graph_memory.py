"""Graphs' memory comes out of the KV cache's budget before it is sized, and where graphs are off
the reason is said (enforce_eager, no CUDA, ranks sharing a GPU over gloo)."""

from __future__ import annotations

import pytest
import torch

from gearshift.worker.config import EngineConfig
from gearshift.worker.engine.loading import kv_cache_blocks
from gearshift.worker.kv.cache import KVCacheSpec
from gearshift.worker.launch import rank_graphs

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
PER_BLOCK = SPEC.bytes_per_block  # 512 bytes


def test_on_cuda_the_graph_pool_is_kept_out_of_the_free_memory_fraction(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1000 * PER_BLOCK, 0))
    config = EngineConfig(model="m", device="cuda", block_size=4, gpu_memory_utilization=0.5)
    cuda = torch.device("cuda")
    assert kv_cache_blocks(config, SPEC, cuda, 16) == 500
    assert kv_cache_blocks(config, SPEC, cuda, 16, reserve_bytes=100 * PER_BLOCK) == 400


def test_on_cpu_a_default_budget_loses_the_reserve_and_an_explicit_one_does_not():
    cpu = torch.device("cpu")
    default = EngineConfig(model="m", block_size=4, max_num_seqs=10**6)
    full = kv_cache_blocks(default, SPEC, cpu, 4096)
    assert kv_cache_blocks(default, SPEC, cpu, 4096, reserve_bytes=10 * PER_BLOCK) == full - 10
    explicit = EngineConfig(model="m", block_size=4, kv_cache_bytes=100 * PER_BLOCK)
    assert kv_cache_blocks(explicit, SPEC, cpu, 16, reserve_bytes=10 * PER_BLOCK) == 100


def test_a_reserve_that_leaves_no_room_is_refused_naming_the_budget(monkeypatch):
    from gearshift.worker.errors import InvalidRequestError

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * PER_BLOCK, 0))
    config = EngineConfig(model="m", device="cuda", block_size=4)
    with pytest.raises(InvalidRequestError) as info:
        kv_cache_blocks(config, SPEC, torch.device("cuda"), 64, reserve_bytes=100 * PER_BLOCK)
    assert info.value.field == "kv_cache_bytes"


def test_why_graphs_are_off_is_said():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert "enforce_eager" in rank_graphs.eager_reason(
        EngineConfig(model="m", enforce_eager=True, graphs_on_cpu=True), cpu, 1
    )
    assert "CUDA" in rank_graphs.eager_reason(EngineConfig(model="m"), cpu, 1)
    assert rank_graphs.eager_reason(EngineConfig(model="m", graphs_on_cpu=True), cpu, 2) is None
    assert rank_graphs.eager_reason(EngineConfig(model="m", device="cuda"), cuda, 1) is None


def test_ranks_sharing_one_gpu_over_gloo_stay_eager(monkeypatch):
    monkeypatch.setattr(rank_graphs.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(rank_graphs.dist, "get_backend", lambda group=None: "gloo")
    config = EngineConfig(model="m", device="cuda:0")
    why = rank_graphs.eager_reason(config, torch.device("cuda", 0), 2)
    assert why is not None and "gloo" in why and "cuda:0" in why
    monkeypatch.setattr(rank_graphs.dist, "get_backend", lambda group=None: "nccl")
    assert (
        rank_graphs.eager_reason(EngineConfig(model="m", device="cuda"), torch.device("cuda", 0), 2)
        is None
    )


def test_static_inputs_hold_the_largest_bucket_and_a_whole_context(tiny_checkpoint, engine_factory):
    engine = engine_factory(
        tiny_checkpoint("llama2-bias"), skip_tokenizer_init=True, graphs_on_cpu=True,
        max_cudagraph_capture_size=8, block_size=4,
    )  # fmt: skip
    graphs = engine.executor.inner.graphs
    assert graphs is not None and graphs.inputs.nbytes > 0
    assert graphs.inputs.tables.shape == (8, -(-256 // 4))  # max_model_len 256 in blocks
