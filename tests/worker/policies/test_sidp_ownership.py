"""SiDP ownership and peak shifting (SiDP §4.1, §4.2): pure arithmetic, every dp and layer count."""

from __future__ import annotations

import pytest

from gearshift.worker.model.config import ModelConfig
from gearshift.worker.policies.sidp.ownership import Ownership, ffn_layer_numel, weight_bytes


@pytest.mark.parametrize("dp", range(2, 9))
@pytest.mark.parametrize("layers", [1, 2, 3, 7, 8, 13, 16, 30])
def test_peak_shifting_fetches_each_remote_layer_once_and_ranks_never_collide(
    dp: int, layers: int
) -> None:
    if layers < dp:
        layers = dp + layers  # the policy refuses dp > layers
    own = Ownership(dp, layers)
    slots = {r: own.fetch_slots(r, peak_shifting=True) for r in range(dp)}
    for k, cycle in enumerate(own.cycles()):
        for r in range(dp):
            fetched = [layer for layer in slots[r][k] if layer is not None]
            # Every non-owned layer of the cycle exactly once, never the rank's own.
            assert sorted(fetched) == [layer for layer in cycle if own.owner(layer) != r]
            assert len(set(fetched)) == len(fetched)
            # The order starts right after the rank's own layer and wraps within the cycle.
            if len(cycle) == dp:
                assert slots[r][k][0] == cycle.start + (r + 1) % dp
        for index in range(dp - 1):
            at_index = [slots[r][k][index] for r in range(dp) if slots[r][k][index] is not None]
            assert len(set(at_index)) == len(at_index), (k, index, at_index)


def test_without_peak_shifting_every_rank_fetches_in_layer_order() -> None:
    own = Ownership(4, 8)
    assert own.fetch_order(1, peak_shifting=False) == [0, 2, 3, 4, 6, 7]
    assert own.fetch_order(1, peak_shifting=True) == [2, 3, 0, 6, 7, 4]
    firsts = {own.fetch_order(r, peak_shifting=False)[0] for r in range(1, 4)}
    assert firsts == {0}  # the incast peak shifting avoids: everyone at layer 0's owner


def test_each_cycle_has_one_layer_per_replica_and_every_layer_one_owner() -> None:
    own = Ownership(3, 10)
    assert [own.owned(r) for r in range(3)] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    for cycle in own.cycles()[:-1]:
        assert sorted(own.owner(layer) for layer in cycle) == [0, 1, 2]


def _cfg(**kw: object) -> ModelConfig:
    base: dict[str, object] = {
        "model_type": "llama",
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_layers": 6,
        "num_heads": 8,
        "num_kv_heads": 2,
        "head_dim": 8,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 256,
    }
    base.update(kw)
    return ModelConfig(**base)  # type: ignore[arg-type]


def test_weight_formula_counts_replicated_owned_and_slots() -> None:
    cfg = _cfg(mlp_bias=True)
    own = Ownership(3, 6)
    wb = weight_bytes(cfg, own, replica=1, slots=2, element_size=4)
    assert wb.ffn_layer == 4 * (3 * 64 * 128 + 2 * 128 + 64)
    assert wb.owned_layers == 2
    assert wb.resident == wb.replicated + 2 * wb.ffn_layer + 2 * wb.ffn_layer
    # Plain DP holds all 6 FFN layers; SiDP 2 owned + 2 slots: 2 layers freed.
    assert wb.freed(6) == 2 * wb.ffn_layer
    assert ffn_layer_numel(_cfg()) == 3 * 64 * 128


def test_weight_formula_with_tp_counts_each_ranks_shard() -> None:
    cfg = _cfg(mlp_bias=True, tie_word_embeddings=True)
    own = Ownership(2, 6)
    one = weight_bytes(cfg, own, replica=0, slots=1, element_size=4)
    two = weight_bytes(cfg, own, replica=0, slots=1, element_size=4, tp=2)
    # gate/up rows and down columns halve; down's bias (64) stays whole on every TP rank.
    assert two.ffn_layer == 4 * (3 * 64 * 64 + 2 * 64 + 64)
    # Per layer: q 4 heads, kv 1 head of 8, o over 32 inputs, two norms; embedding 64 rows.
    attn = 64 * (32 + 2 * 8) + 32 * 64 + 2 * 64
    assert two.replicated == 4 * (64 * 64 + 6 * attn + 64)
    assert two.replicated < one.replicated and two.owned_layers == one.owned_layers == 3
    # TP 4 over 2 KV heads: one replicated KV head per rank.
    four = weight_bytes(cfg, own, replica=0, slots=1, element_size=4, tp=4)
    attn4 = 64 * (16 + 2 * 8) + 16 * 64 + 2 * 64
    assert four.replicated == 4 * (32 * 64 + 6 * attn4 + 64)
