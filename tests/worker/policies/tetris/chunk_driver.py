"""One pool member of the CDSP execution tests: runs every chunk plan of its pool size on a
checkpoint and saves what it holds (KV rows, their prompt positions) and the last token's
logits to ``<out>/<case>-rank<r>.pt``."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from gearshift.worker.attention.torch_ref import TorchAttention
from gearshift.worker.comm import CommGroup
from gearshift.worker.config import EngineConfig
from gearshift.worker.engine.loading import inspect_model, load_model
from gearshift.worker.p2p import P2P, start_rules
from gearshift.worker.policies.tetris.chunked_prefill import PlannedChunk, Pool, run_chunk_plan

PROMPT_LENGTH = 61


def cases(world: int) -> dict[str, list[PlannedChunk]]:
    """Chunk plans over a pool of ``world`` instances: growing groups, uneven lengths."""
    out = {
        "one_chunk_on_all": [PlannedChunk(PROMPT_LENGTH, tuple(range(world)))],
        "1_then_2": [PlannedChunk(23, (0,)), PlannedChunk(38, (0, 1))],
        "1_then_2_reversed_ring": [PlannedChunk(17, (1,)), PlannedChunk(44, (0, 1)[::-1])],
    }
    if world >= 3:
        out["1_then_2_then_3"] = [
            PlannedChunk(9, (2,)),
            PlannedChunk(20, (2, 0)),
            PlannedChunk(32, (2, 0, 1)),
        ]
        out["2_then_3_short_last"] = [PlannedChunk(55, (0, 1)), PlannedChunk(6, (0, 1, 2))]
    return out


def prompt(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (PROMPT_LENGTH,), generator=torch.Generator().manual_seed(7))


def run_rank(rank: int, world: int, store_path: str, checkpoint: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    start_rules()
    store = dist.FileStore(store_path, world)
    timeout = timedelta(seconds=120)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    cpu = torch.device("cpu")
    comm = CommGroup(world, rank, tuple(range(world)), dist.group.WORLD)
    spec, source = inspect_model(EngineConfig(model=checkpoint, dtype="float32"), cpu)
    model = load_model(spec, source, cpu)
    pool = Pool(comm, P2P(comm, "pool", cpu, timeout), TorchAttention(spec.config.head_dim**-0.5))
    ids = prompt(spec.config.vocab_size)
    for name, plan in cases(world).items():
        result = run_chunk_plan(model, pool, plan, ids)
        torch.save(
            {
                "kv": result.holding.kv,
                "positions": result.holding.positions,
                "last_logits": result.last_logits,
            },
            Path(out_dir, f"{name}-rank{rank}.pt"),
        )
        dist.barrier()
    dist.destroy_process_group()
