"""Two ranks of the rebalance overlap test: rank 0 holds a 3-layer history and sends it by
hand, layer 1 and 2 only after rank 1 says it has used layer 0; rank 1 rebalances onto the ring
{0, 1} and takes layer 0 before it says so. If taking a layer waited for every layer, rank 1
would wait for messages rank 0 only sends later, and both would hang until killed."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from gearshift.worker.comm import CommGroup
from gearshift.worker.policies.tetris import rebalance as rb
from gearshift.worker.policies.tetris.ring import Ring

LAYERS, ROWS, GO_TAG = 3, 6, 7


def history() -> rb.Holding:
    kv = torch.arange(ROWS * LAYERS * 2 * 2 * 4, dtype=torch.float32)
    return rb.Holding(kv.view(ROWS, LAYERS, 2, 2, 4), torch.arange(ROWS) * 10)


def run_rank(rank: int, store_path: str, out_dir: str) -> None:
    store = dist.FileStore(store_path, 2)
    timeout = timedelta(seconds=60)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    comm = CommGroup(2, rank, (0, 1), dist.group.WORLD)
    full = history()
    if rank == 0:
        rows = slice(ROWS // 2, ROWS)  # the even split gives rank 1 the second half
        works = [dist.isend(full.positions[rows].contiguous(), 1, tag=rb._POSITIONS_TAG)]
        works.append(dist.isend(full.kv[rows, 0].contiguous(), 1, tag=rb._LAYER_TAG))
        go = torch.zeros(1)
        dist.recv(go, 1, tag=GO_TAG)
        for i in (1, 2):
            works.append(dist.isend(full.kv[rows, i].contiguous(), 1, tag=rb._LAYER_TAG + i))
        for w in works:
            w.wait()
    else:
        empty = rb.Holding(full.kv[:0], full.positions[:0])
        got = rb.rebalance(empty, {0: ROWS}, Ring(comm, (0, 1)))
        first = got.layer(0)  # must not wait for layers 1 and 2
        dist.send(torch.ones(1), 0, tag=GO_TAG)
        held = got.finish()
        torch.save(
            {"first": first, "kv": held.kv, "positions": held.positions},
            Path(out_dir) / "rank1.pt",
        )
    dist.destroy_process_group()
