"""Create the process groups a layout needs, on every rank in the same order."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from gearshift.worker.comm import CommGroup
from gearshift.worker.parallel.layout import Layout


@dataclass(frozen=True)
class GroupSet:
    """This rank's view of every group of its worker group."""

    world: CommGroup
    tp: CommGroup  # base gear TP (contiguous ranks)
    sp: CommGroup  # Ulysses SP (strided ranks)
    sp_tp: CommGroup  # the shift gear's TP: every rank, SP_TP order (§3.3.2)
    kv_aa: CommGroup  # Alg. 1: ranks holding different KV heads of one TP shard
    kv_ag: CommGroup  # Alg. 1: ranks replicating the same KV head
    pp: CommGroup  # point-to-point between pipeline stages (group rank = stage)

    @staticmethod
    def single() -> GroupSet:
        one = CommGroup.single()
        return GroupSet(one, one, one, one, one, one, one)


def _mine(groups: list[list[int]], rank: int, timeout: timedelta) -> CommGroup:
    # new_group is collective over the whole world: every rank creates every group, in order.
    found = CommGroup(size=1, rank=0, ranks=(rank,))
    for members in groups:
        if len(members) == 1:
            continue
        pg = dist.new_group(members, timeout=timeout)
        if rank in members:
            found = CommGroup(len(members), members.index(rank), tuple(members), pg)
    return found


def kv_replication_groups(
    layout: Layout, num_kv_heads: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Alg. 1's SP_AA and SP_AG groups (global ranks) when SP exceeds the KV heads per TP rank.

    With k KV heads per TP rank and SP = k x r, SP rank s holds head ``s // r``: SP_AA groups
    ({s : s % r == i}) exchange heads, SP_AG groups ({s : s // r == j}) replicate one head.
    """
    k = max(1, num_kv_heads // layout.tp)
    if layout.sp <= k:
        return [], []
    r = layout.sp // k
    aa: list[list[int]] = []
    ag: list[list[int]] = []
    for sp_group in layout.sp_groups():
        aa += [[sp_group[j * r + i] for j in range(k)] for i in range(r)]
        ag += [[sp_group[j * r + i] for i in range(r)] for j in range(k)]
    return aa, ag


def create_groups(layout: Layout, rank: int, num_kv_heads: int, timeout: timedelta) -> GroupSet:
    """Every group of ``layout``; call after ``init_process_group`` on all ranks, in the same
    order on every rank (``new_group`` is collective over the world)."""
    everyone = tuple(range(layout.world_size))
    world = CommGroup(layout.world_size, rank, everyone, dist.group.WORLD)
    tp = _mine(layout.tp_groups(), rank, timeout)
    sp = _mine(layout.sp_groups(), rank, timeout)
    if layout.pp == 1:
        # Same members as the world, in SP_TP order; CommGroup restores that order in gathers.
        order = tuple(layout.sp_tp_order())
        sp_tp = CommGroup(layout.world_size, order.index(rank), order, dist.group.WORLD)
    else:
        sp_tp = _mine([layout.sp_tp_order(st) for st in range(layout.pp)], rank, timeout)
    aa_groups, ag_groups = kv_replication_groups(layout, num_kv_heads)
    kv_aa = _mine(aa_groups, rank, timeout)
    kv_ag = _mine(ag_groups, rank, timeout)
    pp = CommGroup.single()
    if layout.pp > 1:
        # One group for every stage-to-stage send: point-to-point needs no per-pair group.
        pg = dist.new_group(list(everyone), timeout=timeout)
        pp = CommGroup(layout.pp, layout.stage(rank), everyone, pg)
    return GroupSet(world, tp, sp, sp_tp, kv_aa, kv_ag, pp)


def create_control_group(world_size: int, rank: int, timeout: timedelta) -> CommGroup:
    """The leader's channel to every rank: gloo on every platform (StepPlans, keep-alives)."""
    everyone = tuple(range(world_size))
    if world_size == 1:
        return CommGroup.single()
    pg = dist.new_group(list(everyone), backend="gloo", timeout=timeout)
    return CommGroup(world_size, rank, everyone, pg)
