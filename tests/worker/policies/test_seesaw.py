"""Seesaw: PP prefill <-> TP decode over a shared host KV store (gloo, fp32).

The workload is larger than the device KV cache, so prompts go through the host store and the
scheduler makes several transitions; greedy text must equal one process with the same weights.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from gearshift.worker.policies.seesaw.host_kv import PREFIX, SHM_DIR
from gearshift.worker.policies.seesaw.leader import Phase
from gearshift.worker.policies.seesaw.policy import SeesawPolicy
from gearshift.worker.sampling.params import SamplingParams

BLOCK = 4
ENGINE = {
    "skip_tokenizer_init": True,
    "block_size": BLOCK,
    "max_num_batched_tokens": 32,
    "max_model_len": 64,
    "enable_prefix_caching": False,
}
# 4 layers x 2 KV heads x head_dim 8, fp32: 1 KiB per device block on each of two ranks, and
# 2 KiB per host page (every layer and head).
DEVICE_KV = 24 * 1024  # 24 blocks = 96 tokens per rank
HOST_KV = 28 * 2048  # 28 pages = 112 tokens


def _model(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=4)


def _prompts(n: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (6 + (5 * i) % 17,), generator=g).tolist() for i in range(n)]


def _seesaw(prefill: dict, decode: dict, **kw: object) -> dict:
    return {"seesaw": {"prefill": prefill, "decode": decode, "hostKvCapacityBytes": HOST_KV, **kw}}


def _segments() -> set[str]:
    """This process's segments (the groups' leader is rank 0 here; other test processes running
    at once have theirs)."""
    return {p.name for p in SHM_DIR.glob(f"{PREFIX}*-{os.getpid()}-*")}


@pytest.fixture
def no_leftover_segments():
    """Listed first, so it checks after the groups of the test have shut down."""
    before = _segments()
    yield
    assert _segments() <= before, "a host KV segment outlived its group"
    threads = [t.name for t in threading.enumerate() if t.name.startswith("seesaw-")]
    assert threads == [], f"swap threads outlived their group: {threads}"


def _reference(engine_factory, folder: Path, prompts, params) -> list[list[int]]:
    ref = engine_factory(folder, record=False, kv_cache_bytes=64 << 20, **ENGINE)
    return [o.token_ids for o in ref.generate(prompts, params)]


@pytest.mark.parametrize("async_swap", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize(
    ("prefill", "decode"),
    [({"tp": 1, "pp": 2}, {"tp": 2, "pp": 1}), ({"tp": 2, "pp": 1}, {"tp": 1, "pp": 2})],
    ids=["P2-to-T2", "T2-to-P2"],
)
def test_greedy_text_equals_one_process_through_the_host_tier(
    no_leftover_segments,
    tiny_checkpoint,
    group_factory,
    engine_factory,
    prefill,
    decode,
    async_swap,
):
    folder = _model(tiny_checkpoint)
    prompts = _prompts(10)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = _reference(engine_factory, folder, prompts, params)
    engine = group_factory(
        folder,
        # A staging buffer of 3 KiB: swap-outs wait for the writer thread, or bypass it.
        _seesaw(prefill, decode, asyncSwap=async_swap, pinnedStagingBytes=3072),
        kv_cache_bytes=DEVICE_KV,
        **ENGINE,
    )
    got = [o.token_ids for o in engine.generate(prompts, params)]
    assert got == want
    decodes = [p for p in engine.executor.submitted if p.gear == 1 and p.num_decodes]
    if decode["pp"] > 1:
        # §5.1: decode micro-batches fill both pipeline slots, each with part of the sequences.
        assert {p.micro_batch for p in decodes} == {0, 1}
        assert max(p.num_decodes for p in decodes) < len(prompts)
    assert not any(p.prefill_query_lens for p in decodes)  # decode steps hold no prefill
    policy = engine.policy
    assert isinstance(policy, SeesawPolicy) and policy.leader is not None
    log = policy.leader.transitions
    # The workload does not fit the device, nor the host store at once: several round trips.
    assert [t.to for t in log[:3]] == [Phase.DECODE, Phase.PREFILL, Phase.DECODE]
    assert policy.leader.pages.used == 0 and not policy.leader.on_host
    stats = policy.stats()
    assert stats["swap_out_bytes"] > 0 and stats["swap_in_bytes"] > 0
    assert stats["transitions"] == len(log)


def _load(spec, path: Path, tp: int, tp_rank: int, layers: range | None):
    from gearshift.worker.comm import CommGroup
    from gearshift.worker.engine.loading import load_model
    from gearshift.worker.model.weights import open_weight_source

    group = CommGroup(tp, tp_rank, tuple(range(tp)))
    return load_model(spec, open_weight_source(path), torch.device("cpu"), tp=group, layers=layers)


def test_weights_after_each_reshard_equal_the_checkpoint_shard_of_that_layout(tiny_checkpoint):
    from gearshift.worker.config import EngineConfig
    from gearshift.worker.engine.loading import inspect_model
    from gearshift.worker.parallel.layout import stage_layers
    from gearshift.worker.policies.seesaw.weights import WeightSet, checksums

    folder = _model(tiny_checkpoint)
    spec, source = inspect_model(
        EngineConfig(model=str(folder), dtype="float32"), torch.device("cpu")
    )
    source.close()
    for rank in (0, 1):
        # P2 prefill: this rank's stage, all heads; T2 decode: all layers, its TP shard.
        layouts = [(1, 0, stage_layers(4, 2, rank)), (2, rank, None)]
        models = [_load(spec, folder, tp, r, layers) for tp, r, layers in layouts]
        want = [checksums(_load(spec, folder, tp, r, layers)) for tp, r, layers in layouts]
        weights = WeightSet(models, torch.device("cpu"), spec.packing)
        assert weights.working.numel() == max(weights.gear_bytes)  # one gear's size, not two
        for gear in (0, 1, 0, 1):
            record = weights.activate(gear)
            assert record.bytes == weights.gear_bytes[gear] and record.seconds >= 0
            assert checksums(models[gear]) == want[gear]
            # The other gear holds nothing on the device while this one is active.
            assert all(p.numel() == 0 for p in models[1 - gear].parameters())
            ptr = weights.working.data_ptr()
            span = range(ptr, ptr + weights.working.numel())
            assert all(p.data_ptr() in span for p in models[gear].parameters())


def test_a_layout_the_model_cannot_split_is_refused_naming_the_field(tiny_checkpoint):
    from gearshift.worker.errors import InvalidRequestError
    from gearshift.worker.model.config import ModelConfig
    from gearshift.worker.policies.registry import make_policy, parse_policy
    from gearshift.worker.policies.support import check_runnable

    folder = _model(tiny_checkpoint)
    cfg = ModelConfig.from_hf_folder(folder)
    policy = make_policy(_seesaw({"tp": 1, "pp": 2}, {"tp": 2, "pp": 1}))
    policy.check_model(cfg)  # 8 heads, 2 KV heads, 4 layers split both ways
    bad = make_policy({"seesaw": {"prefill": {"tp": 1, "pp": 8}, "decode": {"tp": 8, "pp": 1}}})
    with pytest.raises(InvalidRequestError) as err:
        bad.check_model(cfg)
    assert err.value.field == "policy.seesaw.prefill.pp"
    with pytest.raises(InvalidRequestError) as err:
        check_runnable(
            parse_policy({"seesaw": {"prefill": {"tp": 1, "pp": 4}, "decode": {"tp": 2, "pp": 2}}})
        )
    assert err.value.field == "spec.policy.seesaw.decode"
