"""CDSP execution (Tetris §4.1): a request's chunk plan over growing instance groups, history
KV rebalanced before each chunk, zig-zag ring attention within it. The pool's KV (gathered by
prompt position) and the last token's logits equal Hugging Face's single-process forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gearshift.worker.launch.processes import run_ranks
from gearshift.worker.policies.tetris.chunked_prefill import PlannedChunk, check_plan
from tests.worker.policies.tetris import chunk_driver

TOL = 2e-4  # fp32, a different summation order than Hugging Face's


def _run_pool(world: int, checkpoint: Path, tmp: Path) -> None:
    args = (world, str(tmp / "store"), str(checkpoint), str(tmp))
    codes = run_ranks(chunk_driver.run_rank, [(r, *args) for r in range(world)], "pool", 300)
    assert codes == [0] * world, "a pool member failed or hung"


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


@pytest.mark.parametrize("mode", ["whole", "stream"])
def test_kv_handed_to_a_tp2_decode_instance_continues_like_one_process(
    tiny_checkpoint, tmp_path, mode
):
    """Prefill on a pool of two (plan 1 → 2), the KV sent head-split to a decode instance of
    TP 2 (whole after the prefill, or streamed layer by layer while it computes), written into
    its paged cache at a permuted block table, then greedy decoding there."""
    from tests.worker.policies.tetris import handoff_driver

    checkpoint = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=2)
    args = (str(tmp_path / "store"), str(checkpoint), str(tmp_path), mode)
    codes = run_ranks(handoff_driver.run_rank, [(r, *args) for r in range(4)], "rank", 300)
    assert codes == [0] * 4, "a rank failed or hung"
    from transformers import AutoModelForCausalLM

    ids = chunk_driver.prompt(128)
    want_kv, _ = _hf_reference(checkpoint, ids)  # [L, layers, 2, Hkv, D]
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            ids[None], max_new_tokens=handoff_driver.NEW_TOKENS, do_sample=False, top_p=None
        )
    want_tokens = out[0, chunk_driver.PROMPT_LENGTH :].tolist()
    decode = [torch.load(tmp_path / f"decode{r}.pt") for r in handoff_driver.DECODE]
    # Each decode rank holds its KV head (2 heads over TP 2) of every prompt token.
    got_kv = torch.cat([d["prompt_kv"] for d in decode], dim=2)  # [layers, 2, Hkv, L, D]
    assert (got_kv.permute(3, 0, 1, 2, 4) - want_kv).abs().max() < TOL
    assert decode[0]["tokens"] == decode[1]["tokens"] == want_tokens


def test_decode_head_split_follows_the_qkv_projection_and_bad_transfers_are_refused():
    from gearshift.worker.policies.tetris.handoff import Transfer, kv_heads_of

    assert [kv_heads_of(t, 2, 4) for t in range(2)] == [slice(0, 2), slice(2, 4)]
    assert [kv_heads_of(t, 4, 2) for t in range(4)] == [slice(0, 1)] * 2 + [slice(1, 2)] * 2
    with pytest.raises(ValueError, match="do not split"):
        kv_heads_of(0, 3, 4)
    with pytest.raises(ValueError, match="not a multiple"):
        kv_heads_of(0, 3, 2)
    with pytest.raises(ValueError, match="cannot share ranks"):
        Transfer({0: 5, 1: 5}, (1, 2), 0)
    with pytest.raises(ValueError, match="sends no KV"):
        Transfer({0: 5}, (1,), 2)


def test_a_layers_history_is_waited_for_only_when_that_layer_needs_it(tmp_path: Path) -> None:
    # Overlap proven by order, not timing: rank 0 sends layers 1 and 2 only after rank 1 has
    # used layer 0 (rebalance_driver.py); a rebalance that waited for every layer up front would
    # hang here until run_ranks kills it.
    from tests.worker.policies.tetris import rebalance_driver as drv

    store = str(tmp_path / "store")
    codes = run_ranks(drv.run_rank, [(r, store, str(tmp_path)) for r in range(2)], "rebal", 90)
    assert codes == [0, 0]
    got = torch.load(tmp_path / "rank1.pt")
    want = drv.history()
    half = slice(drv.ROWS // 2, drv.ROWS)
    assert torch.equal(got["first"], want.kv[half, 0])
    assert torch.equal(got["kv"], want.kv[half])
    assert torch.equal(got["positions"], want.positions[half])


def test_a_streamed_piece_from_a_dead_sender_fails_when_completed(tmp_path):
    """A decode rank that posts a streamed piece's receives after its sender died (a grant in
    the moment before the group noticed) does not crash: completing the piece raises, which
    the decode instance records as a failed transfer."""
    from tests.worker.policies.tetris import handoff_driver

    args = (str(tmp_path / "store"), str(tmp_path))
    codes = run_ranks(handoff_driver.run_dead_sender, [(r, *args) for r in range(2)], "rank", 120)
    assert codes == [0, 0], codes
    assert (tmp_path / "dead_sender.txt").read_text().startswith("raised")
