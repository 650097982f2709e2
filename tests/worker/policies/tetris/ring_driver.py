"""One rank of the ring-attention tests: runs every case of its world size against a float64
single-process reference and writes the largest errors it saw to ``<out>/rank-<r>.json``."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from gearshift.worker.comm import CommGroup
from gearshift.worker.p2p import P2P, start_rules
from gearshift.worker.policies.tetris.ring import History, Ring, ring_attention_with_history
from gearshift.worker.policies.tetris.zigzag import ZigZag, even_split

D = 8


@dataclass(frozen=True)
class Case:
    name: str
    members: tuple[int, ...]  # group ranks in ring order (of the pool group, see run_rank)
    length: int  # chunk tokens
    history: int  # earlier chunks' tokens, spread evenly over the ring
    hq: int
    hkv: int


def cases(world: int) -> list[Case]:
    everyone = tuple(range(world))
    out = [
        Case("even_mha", everyone, 2 * world * 4, 0, 4, 4),
        Case("uneven_gqa", everyone, 2 * world * 5 + 3, 0, 8, 2),
        Case("history_gqa", everyone, 2 * world * 3 + 1, 4 * world + 3, 6, 2),
        Case("short_mqa_history", everyone, world, 5, 4, 1),
        Case("reversed_ring_history", everyone[::-1], 2 * world * 4 + 1, 2 * world - 1, 8, 2),
    ]
    if world == 3:  # rings over a subset of the group's ranks, without creating a group
        out += [
            Case("subset_0_2", (0, 2), 11, 0, 8, 2),
            Case("subset_2_0_history", (2, 0), 13, 7, 8, 2),
        ]
    if world == 4:  # a pool group of global ranks 1..3: group rank r is global rank r + 1
        out += [Case("pool_group_2_0", (2, 0), 17, 5, 8, 2)]
    return out


def pool_case(case: Case) -> bool:
    return case.name.startswith("pool_group")


def reference(case: Case, seed: int) -> tuple[torch.Tensor, ...]:
    """The case's tensors (float64) and single-process causal attention over history + chunk."""
    g = torch.Generator().manual_seed(seed)
    n, h = case.length, case.history
    q = torch.randn(n, case.hq, D, generator=g, dtype=torch.float64)
    k = torch.randn(h + n, case.hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(h + n, case.hkv, D, generator=g, dtype=torch.float64)
    group = case.hq // case.hkv
    keys = k.repeat_interleave(group, dim=1)  # [h + n, Hq, D]
    values = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, keys) * D**-0.5
    hidden = torch.arange(h + n)[None, :] > (h + torch.arange(n))[:, None]
    scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [Hq, n]
    out = torch.einsum("hnl,lhd->nhd", torch.softmax(scores, dim=-1), values)
    return q, k, v, out, lse.transpose(0, 1)


def run_case(case: Case, channel: P2P, seed: int) -> dict[str, float]:
    q, k, v, want_out, want_lse = reference(case, seed)
    ring = Ring(channel.comm, case.members, channel)
    me = ring.index
    layout = ZigZag(case.length, ring.size)
    lengths = even_split(case.history, ring.size)
    lo = sum(lengths[:me])
    hist = History(k[lo : lo + lengths[me]].float(), v[lo : lo + lengths[me]].float(), lengths)
    chunk_k, chunk_v = k[case.history :].float(), v[case.history :].float()
    out, lse = ring_attention_with_history(
        layout.split(q.float(), me),
        layout.split(chunk_k, me),
        layout.split(chunk_v, me),
        hist,
        ring,
        layout,
        D**-0.5,
    )
    return {
        "rows": float(out.shape[0]),
        "out_err": _max_err(out, layout.split(want_out, me)),
        "lse_err": _max_err(lse, layout.split(want_lse, me)),
    }


def _max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        return float("inf")
    return float((got.double() - want).abs().max()) if got.numel() else 0.0


def run_rank(rank: int, world: int, store_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    start_rules()  # GEARSHIFT_COMM_RULES, as a rank of a group reads it
    store = dist.FileStore(store_path, world)
    timeout = timedelta(seconds=60)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    cpu = torch.device("cpu")
    world_comm = CommGroup(world, rank, tuple(range(world)), dist.group.WORLD)
    world_channel = P2P(world_comm, "ring test", cpu, timeout)
    pool_channel = None
    if world == 4:  # new_group is collective: every rank creates it
        pg = dist.new_group([1, 2, 3])
        if rank >= 1:
            pool_channel = P2P(CommGroup(3, rank - 1, (1, 2, 3), pg), "ring pool", cpu, timeout)
    results: dict[str, dict[str, float]] = {}
    for seed, case in enumerate(cases(world)):
        channel = pool_channel if pool_case(case) else world_channel
        if channel is not None and channel.comm.rank in case.members:
            results[case.name] = run_case(case, channel, seed)
        dist.barrier()
    dist.destroy_process_group()
    Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    run_rank(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
