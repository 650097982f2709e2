"""Rank order and head ownership (Shift §3.3.1, Fig. 7), checked against the sharded layers."""

from __future__ import annotations

import itertools

import pytest
import torch

from gearshift.worker.comm import CommGroup
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.model.layers.linear import QKVParallelLinear
from gearshift.worker.parallel.groups import kv_replication_groups
from gearshift.worker.parallel.layout import Layout


def test_figure7_groups_for_sp3_tp2():
    layout = Layout(sp=3, tp=2)
    assert layout.tp_groups() == [[0, 1], [2, 3], [4, 5]]
    assert layout.sp_groups() == [[0, 2, 4], [1, 3, 5]]
    assert layout.sp_tp_order() == [0, 2, 4, 1, 3, 5]
    # Global rank r attends over head block t*SP + s in both gears: (0, 3, 1, 4, 2, 5).
    assert [layout.head_block(r) for r in range(6)] == [0, 3, 1, 4, 2, 5]


def _qkv(heads: int, kv_heads: int, size: int, rank: int) -> QKVParallelLinear:
    return QKVParallelLinear(
        8,
        2,
        heads,
        kv_heads,
        False,
        CommGroup(size, rank, tuple(range(size))),
        torch.float32,
        torch.device("meta"),
    )


def _base_gear_heads(
    layout: Layout, rank: int, heads: int, kv_heads: int
) -> tuple[list[int], list[int]]:
    """What the base gear's sharded QKV layer loads, then what Ulysses' all-to-all hands out."""
    t, s, sp = layout.tp_rank(rank), layout.sp_rank(rank), layout.sp
    qkv = _qkv(heads, kv_heads, layout.tp, t)
    q_tp = list(range(t * qkv.num_heads, (t + 1) * qkv.num_heads))
    kv_tp = list(range(qkv.kv_head_index, qkv.kv_head_index + qkv.num_kv_heads))
    q = q_tp[s * len(q_tp) // sp : (s + 1) * len(q_tp) // sp]
    if len(kv_tp) % sp == 0:
        kv = kv_tp[s * len(kv_tp) // sp : (s + 1) * len(kv_tp) // sp]
    else:  # Alg. 1: SP rank s serves head s // (SP / k)
        kv = [kv_tp[s // (sp // len(kv_tp))]]
    return q, kv


def _shift_gear_heads(
    layout: Layout, rank: int, heads: int, kv_heads: int
) -> tuple[list[int], list[int]]:
    """What the shift gear's QKV layer loads as TP over every rank in SP_TP order."""
    position = layout.sp_tp_order().index(rank)
    qkv = _qkv(heads, kv_heads, layout.world_size, position)
    q = list(range(position * qkv.num_heads, (position + 1) * qkv.num_heads))
    return q, list(range(qkv.kv_head_index, qkv.kv_head_index + qkv.num_kv_heads))


CASES = [
    (sp, tp, heads, kv)
    for sp, tp in itertools.product((1, 2, 3, 4), (1, 2, 3, 4))
    for heads, kv in ((8, 2), (8, 4), (8, 8), (12, 4), (12, 2), (9, 3), (24, 1))
    if heads % (sp * tp) == 0
    and (tp % kv == 0 if tp >= kv else kv % tp == 0)
    and ((sp * tp) % kv == 0 if sp * tp >= kv else kv % (sp * tp) == 0)
]


@pytest.mark.parametrize(("sp", "tp", "heads", "kv"), CASES)
def test_base_and_shift_gears_own_the_same_heads_on_every_rank(sp, tp, heads, kv):
    layout = Layout(sp=sp, tp=tp)
    layout.check_model(heads, kv)
    for rank in range(layout.world_size):
        base = _base_gear_heads(layout, rank, heads, kv)
        shift = _shift_gear_heads(layout, rank, heads, kv)
        assert base == shift, (rank, base, shift)
        per = layout.kv_heads_per_rank(kv)
        start = layout.kv_head_start(rank, kv)
        assert base[1] == list(range(start, start + per))
        block = layout.head_block(rank)
        assert base[0] == list(
            range(block * heads // layout.world_size, (block + 1) * heads // layout.world_size)
        )


def test_kv_replication_groups_follow_algorithm_1():
    # SP 4 with 2 KV heads: r = 2 replicas per head; AA groups exchange, AG groups replicate.
    aa, ag = kv_replication_groups(Layout(sp=4, tp=1), 2)
    assert aa == [[0, 2], [1, 3]]
    assert ag == [[0, 1], [2, 3]]
    assert kv_replication_groups(Layout(sp=2, tp=1), 4) == ([], [])


@pytest.mark.parametrize(
    ("sp", "tp", "heads", "kv", "field"),
    [(1, 3, 8, 2, "world_size"), (2, 3, 12, 4, "tp"), (3, 1, 9, 2, "world_size")],
)
def test_layouts_that_do_not_split_are_refused_by_name(sp, tp, heads, kv, field):
    with pytest.raises(InvalidRequestError) as info:
        Layout(sp=sp, tp=tp).check_model(heads, kv)
    assert info.value.field == field
