"""Measured (C, L, seconds) samples of CDSP prefill per SP size, for fitting Eq. (1) (Tetris
§5.1: the latency models are fitted offline from profiling).

A local pool of ``instances`` members (one process each, gloo, TP 1, the whole model) runs, for
every SP size s up to the pool's size and every (history C, chunk L) point, a plan of a C-token
chunk then an L-token chunk on the first s members, and times the second chunk: its rebalance
(none: the group does not change), its ring attention and the model around it. The chunk's
latency is its slowest member's. ``gearshift tetris-profile`` fits and prints the models.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from gearshift.worker.attention.torch_ref import TorchAttention
from gearshift.worker.comm import CommGroup
from gearshift.worker.config import EngineConfig
from gearshift.worker.engine.loading import inspect_model, load_model
from gearshift.worker.launch.processes import run_ranks
from gearshift.worker.p2p import P2P, start_rules
from gearshift.worker.policies.tetris.chunked_prefill import PlannedChunk, Pool, run_chunk_plan


@dataclass(frozen=True)
class ProfilePoints:
    """The (C, L) grid every SP size is measured on, and how many times each point runs."""

    histories: tuple[int, ...]
    lengths: tuple[int, ...]
    repeats: int = 1

    def check(self, max_model_len: int | None = None) -> None:
        """Refuse a grid Eq. (1) cannot be fitted from (or, given ``max_model_len``, that the
        model cannot run)."""
        if not self.lengths or min(self.lengths) < 1 or min(self.histories, default=0) < 0:
            raise ValueError("profile lengths must be >= 1 and histories >= 0")
        if self.repeats < 1:
            raise ValueError(f"repeats must be at least 1, got {self.repeats}")
        # a + b·L + c·C·L + d·L²: three lengths tell L² from L, two histories give C·L.
        if len(set(self.lengths)) < 3 or len(set(self.histories)) < 2:
            raise ValueError("Eq. (1) needs at least three lengths and two histories")
        if max_model_len is not None and max(self.histories) + max(self.lengths) > max_model_len:
            raise ValueError(
                f"history + length up to {max(self.histories) + max(self.lengths)} exceeds the "
                f"model's {max_model_len} positions"
            )


def _member(
    rank: int, world: int, store_path: str, model: str, plans: list[list[PlannedChunk]], out: str
) -> None:
    torch.set_num_threads(1)
    start_rules()
    store = dist.FileStore(store_path, world)
    timeout = timedelta(seconds=600)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    cpu = torch.device("cpu")
    comm = CommGroup(world, rank, tuple(range(world)), dist.group.WORLD)
    spec, source = inspect_model(EngineConfig(model=model, dtype="float32"), cpu)
    net = load_model(spec, source, cpu)
    channel = P2P(comm, "tetris profile pool", cpu, timeout) if world > 1 else None
    pool = Pool(comm, channel, TorchAttention(spec.config.head_dim**-0.5))
    gen = torch.Generator().manual_seed(0)
    seconds: list[list[float]] = []
    # Untimed: the first forward pays one-off costs (allocator growth, lazy initialisation).
    warm = plans[0] if plans else []
    if warm:
        ids = torch.randint(
            0, spec.config.vocab_size, (sum(c.length for c in warm),), generator=gen
        )
        run_chunk_plan(net, pool, warm, ids)
    for plan in plans:
        length = sum(c.length for c in plan)
        ids = torch.randint(0, spec.config.vocab_size, (length,), generator=gen)
        timings: list[float] = []
        dist.barrier()
        run_chunk_plan(net, pool, plan, ids, timings)
        slowest = torch.tensor(timings, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a chunk ends with its slowest member
        seconds.append(slowest.tolist())
    if rank == 0:
        Path(out).write_text(json.dumps(seconds))
    dist.barrier()
    dist.destroy_process_group()


def time_plans(
    model: str,
    instances: int,
    plans: list[list[PlannedChunk]],
    work_dir: Path,
    timeout_s: float = 3600,
) -> list[list[float]]:
    """Each plan's per-chunk seconds (its slowest member's), run in order on a local pool of
    ``instances`` members (random prompts of the plan's length)."""
    if instances < 1:
        raise ValueError(f"instances must be at least 1, got {instances}")
    out = work_dir / "seconds.json"
    args = (instances, str(work_dir / "store"), model, plans, str(out))
    codes = run_ranks(_member, [(r, *args) for r in range(instances)], "gs-tetris", timeout_s)
    if any(code != 0 for code in codes):
        raise RuntimeError(f"a profile member failed or hung (exit codes {codes})")
    return [list(map(float, row)) for row in json.loads(out.read_text())]


def profile_pool(
    model: str, instances: int, points: ProfilePoints, work_dir: Path, timeout_s: float = 3600
) -> dict[int, list[tuple[int, int, float]]]:
    """(C, L, seconds) samples per SP size 1..``instances``, measured on a local pool: for each
    point a plan of C tokens then L tokens on the first s members, timing the second chunk."""
    keys, plans = [], []
    for sp in range(1, instances + 1):
        group = tuple(range(sp))
        for history in points.histories:
            for length in points.lengths:
                plan = [PlannedChunk(length, group)]
                if history:
                    plan.insert(0, PlannedChunk(history, group))
                for _ in range(points.repeats):
                    keys.append((sp, history, length))
                    plans.append(plan)
    seconds = time_plans(model, instances, plans, work_dir, timeout_s)
    samples: dict[int, list[tuple[int, int, float]]] = {}
    for (sp, history, length), row in zip(keys, seconds, strict=True):
        samples.setdefault(sp, []).append((history, length, row[-1]))
    return samples
