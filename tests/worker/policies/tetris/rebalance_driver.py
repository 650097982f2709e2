"""Two ranks of the rebalance overlap test: rank 0 holds a 3-layer history and sends it by
hand on the channel, layers 1 and 2 only after rank 1 says it has used layer 0; rank 1
rebalances onto the ring {0, 1} and takes layer 0 before it says so. If taking a layer waited
for every layer, rank 1 would wait for messages rank 0 only sends later, and both would hang
until killed. The labels are the rebalance's own, so the NCCL-rules mode checks them."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from gearshift.worker.comm import CommGroup
from gearshift.worker.p2p import P2P, start_rules
from gearshift.worker.policies.tetris import rebalance as rb
from gearshift.worker.policies.tetris.ring import Ring

LAYERS, ROWS = 3, 6


def history() -> rb.Holding:
    kv = torch.arange(ROWS * LAYERS * 2 * 2 * 4, dtype=torch.float32)
    return rb.Holding(kv.view(ROWS, LAYERS, 2, 2, 4), torch.arange(ROWS) * 10)


def run_rank(rank: int, store_path: str, out_dir: str) -> None:
    start_rules()
    store = dist.FileStore(store_path, 2)
    timeout = timedelta(seconds=60)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    comm = CommGroup(2, rank, (0, 1), dist.group.WORLD)
    channel = P2P(comm, "rebalance test", torch.device("cpu"), timeout)
    full = history()
    if rank == 0:
        half = rb._Move(1, ROWS // 2, ROWS, slice(ROWS // 2, ROWS))  # the even split's 2nd half
        channel.send(full.kv[half.rows, 0], 1, half.label("L0")).wait()
        channel.recv(torch.zeros(1), 1, "go").wait()
        for i in (1, 2):
            channel.send(full.kv[half.rows, i], 1, half.label(f"L{i}")).wait()
        channel.send(full.positions[half.rows], 1, half.label("positions")).wait()
    else:
        empty = rb.Holding(full.kv[:0], full.positions[:0])
        got = rb.rebalance(empty, {0: ROWS}, Ring(comm, (0, 1), channel))
        first = got.layer(0)  # must not wait for layers 1 and 2
        channel.send(torch.ones(1), 0, "go").wait()
        held = got.finish()
        torch.save(
            {"first": first, "kv": held.kv, "positions": held.positions},
            Path(out_dir) / "rank1.pt",
        )
    dist.destroy_process_group()
