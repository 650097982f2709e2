"""CDSP execution (Tetris §4.1): a request's chunk plan over growing instance groups, history
KV rebalanced before each chunk, zig-zag ring attention within it. The pool's KV (gathered by
prompt position) and the last token's logits equal Hugging Face's single-process forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gearshift.worker.launch.processes import rank_context
from gearshift.worker.policies.tetris.chunked_prefill import PlannedChunk, check_plan
from tests.worker.policies.tetris import chunk_driver

TOL = 2e-4  # fp32, a different summation order than Hugging Face's


def _run_pool(world: int, checkpoint: Path, tmp: Path) -> None:
    ctx = rank_context()
    procs = [
        ctx.Process(
            target=chunk_driver.run_rank,
            args=(r, world, str(tmp / "store"), str(checkpoint), str(tmp)),
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=300)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    assert [p.exitcode for p in procs] == [0] * world, "a pool member failed or hung"


def _hf_reference(checkpoint: Path, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(KV [L, layers, 2, Hkv, D] after RoPE, last-token logits) from transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(ids[None], use_cache=True)
    cache = out.past_key_values
    layers = []
    for i in range(model.config.num_hidden_layers):
        k, v = cache.layers[i].keys[0], cache.layers[i].values[0]  # [Hkv, L, D]
        layers.append(torch.stack((k.transpose(0, 1), v.transpose(0, 1)), dim=1))
    return torch.stack(layers, dim=1), out.logits[0, -1]


@pytest.mark.parametrize(
    ("family", "world"),
    [("llama2-bias", 2), ("qwen3", 2), pytest.param("llama2-bias", 3, marks=pytest.mark.slow)],
)
def test_chunk_plans_on_growing_groups_equal_one_process(family, world, tiny_checkpoint, tmp_path):
    checkpoint = tiny_checkpoint(family, num_heads=8, num_kv_heads=2, layers=2)
    _run_pool(world, checkpoint, tmp_path)
    want_kv, want_logits = _hf_reference(checkpoint, chunk_driver.prompt(128))
    for name, plan in chunk_driver.cases(world).items():
        parts = [torch.load(tmp_path / f"{name}-rank{r}.pt") for r in range(world)]
        positions = torch.cat([p["positions"] for p in parts])
        # Every prompt token's KV is held by exactly one member of the last group.
        assert sorted(positions.tolist()) == list(range(chunk_driver.PROMPT_LENGTH)), name
        held = {r for r, p in enumerate(parts) if len(p["positions"])}
        assert held <= set(plan[-1].group), name
        kv = torch.cat([p["kv"] for p in parts])[positions.argsort()]
        assert (kv - want_kv).abs().max() < TOL, name
        logits = [p["last_logits"] for p in parts if p["last_logits"] is not None]
        assert len(logits) == 1, f"{name}: one member computes the last token's logits"
        assert (logits[0][0] - want_logits).abs().max() < TOL, name
        assert int(logits[0][0].argmax()) == int(want_logits.argmax()), name


def test_plans_the_pool_cannot_run_are_refused_naming_why():
    ok = [PlannedChunk(4, (0,)), PlannedChunk(6, (0, 1))]
    check_plan(ok, 10, 2)
    with pytest.raises(ValueError, match="add up to 9"):
        check_plan([PlannedChunk(4, (0,)), PlannedChunk(5, (0, 1))], 10, 2)
    with pytest.raises(ValueError, match="drops a previous member"):
        check_plan([PlannedChunk(4, (1,)), PlannedChunk(6, (0,))], 10, 2)
    with pytest.raises(ValueError, match="outside a pool of 2"):
        check_plan([PlannedChunk(10, (0, 2))], 10, 2)
    with pytest.raises(ValueError, match="distinct members"):
        check_plan([PlannedChunk(10, (1, 1))], 10, 2)
    with pytest.raises(ValueError, match="at least one chunk"):
        check_plan([], 10, 2)
