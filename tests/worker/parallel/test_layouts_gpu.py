"""Multi-rank layouts on one GPU (marked gpu: skipped without one).

Ranks pinned to GPU 0 (``device: cuda:0``) share it over gloo, and their device tensors cross
through host memory (``comm.via_host``). That is not how a deployment runs (one GPU per rank, NCCL),
but it runs every layout's device code (TP shards, Ulysses all-to-all, pipeline sends, Shift's two
gears, Seesaw's pinned re-shards and swaps) on a machine with one GPU. The reference is the
one-process engine on the same GPU, fp32.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gearshift.worker.config import EngineConfig
from gearshift.worker.launch import start_engine
from gearshift.worker.sampling.params import SamplingParams
from tests.worker.helpers import RecordingExecutor, run_recording
from tests.worker.parallel.test_layouts_match_reference import ENGINE, LAYOUTS, _schedule

pytestmark = pytest.mark.gpu

GPU = {"device": "cuda:0", "attention_backend": "torch"}


@pytest.fixture(scope="module")
def gpu_reference(tiny_checkpoint):
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2)
    engine = start_engine(
        EngineConfig(model=str(folder), dtype="float32", kv_cache_bytes=32 << 20, **ENGINE, **GPU)
    )
    engine.executor = RecordingExecutor(engine.executor)
    rows = run_recording(engine, _schedule())
    engine.shutdown()
    return folder, rows


@pytest.mark.parametrize("name", ["tp2", "sp2", "pp2", "pp2tp2", "shift-base", "shift-tp"])
def test_layouts_sharing_one_gpu_give_the_one_process_logits(name, gpu_reference, group_factory):
    folder, want = gpu_reference
    engine = group_factory(folder, LAYOUTS[name], **ENGINE, **GPU)
    rows = run_recording(engine, _schedule())
    assert rows.keys() == want.keys()
    for rid, entries in rows.items():
        assert [c for c, _ in entries] == [c for c, _ in want[rid]], rid
        for (_, got), (_, ref) in zip(entries, want[rid], strict=True):
            torch.testing.assert_close(got.float().cpu(), ref.float().cpu(), atol=2e-4, rtol=2e-4)


def test_seesaw_on_one_gpu_keeps_the_greedy_text_through_the_host_tier(
    tiny_checkpoint, group_factory, engine_factory
):
    from tests.worker.policies.test_seesaw import (
        DEVICE_KV,
        _model,
        _prompts,
        _seesaw,
    )
    from tests.worker.policies.test_seesaw import (
        ENGINE as SEESAW_ENGINE,
    )

    folder: Path = _model(tiny_checkpoint)
    prompts = _prompts(10)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    ref = engine_factory(folder, record=False, kv_cache_bytes=64 << 20, **SEESAW_ENGINE, **GPU)
    want = [o.token_ids for o in ref.generate(prompts, params)]
    engine = group_factory(
        folder,
        _seesaw({"tp": 1, "pp": 2}, {"tp": 2, "pp": 1}, pinnedStagingBytes=3072),
        kv_cache_bytes=DEVICE_KV,
        **SEESAW_ENGINE,
        **GPU,
    )
    got = [o.token_ids for o in engine.generate(prompts, params)]
    assert got == want
    stats = engine.policy.stats()
    assert stats["swap_out_bytes"] > 0 and stats["swap_in_bytes"] > 0 and stats["transitions"] >= 2
