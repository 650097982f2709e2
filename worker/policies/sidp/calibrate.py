"""AUTO's thresholds measured on the running group at start-up (SiDP §4.3: B_th "derived from
offline profiling" per GPU and model; here the profile is taken where the group runs).

Every rank of the group, right after loading, times decode steps of its model at a few batch
sizes per replica in WaS and in CaS, interleaved (WaS then CaS at each size, repeated), over a
scratch KV cache of its own: each of B sequences has ``CONTEXT_BLOCKS`` blocks of context. All
replicas run the same sizes at once, as they would in the tail of a job (in CaS they have to: the
rows meet at the owner). The median of each rank's repetitions, then the largest over the group's
ranks (every rank gets the same figures and so the same thresholds), is the step time per mode;
``thresholds.thresholds_from_profile`` picks the crossover. Attention, norms and the LM head do
the same work in both modes, so only what differs (slot waits vs row exchanges) moves the
crossover, but it is timed inside whole steps, where WaS's prefetch overlaps compute.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from gearshift.worker.attention.core import AttentionCore
from gearshift.worker.attention.metadata import AttentionMetadata
from gearshift.worker.kv.cache import KVCacheSpec, allocate_kv_cache
from gearshift.worker.model.llama import LlamaForCausalLM
from gearshift.worker.policies.sidp.cas import CasExchange, CasStats
from gearshift.worker.policies.sidp.ffn import FfnService, Mode
from gearshift.worker.policies.sidp.housekeeper import WasStats
from gearshift.worker.policies.sidp.thresholds import SOURCE_MEASURED, ModeProfile

BATCHES = (1, 4, 16, 64)  # batch sizes per replica (the paper's B_th of 32 lies inside)
CONTEXT_BLOCKS = 1
REPEATS = 3


def _decode_step(
    batch: int, block_size: int, vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(ids, positions, metadata) of one decode token for each of ``batch`` sequences, sequence
    b owning blocks [b * CONTEXT_BLOCKS, (b + 1) * CONTEXT_BLOCKS) of the scratch cache."""
    context = CONTEXT_BLOCKS * block_size
    rows = torch.arange(batch, dtype=torch.int64)
    ids = torch.randint(0, vocab, (batch,), generator=torch.Generator().manual_seed(batch))
    tables = rows[:, None] * CONTEXT_BLOCKS + torch.arange(CONTEXT_BLOCKS)[None, :]
    meta = AttentionMetadata(
        num_decodes=batch,
        slot_mapping=(rows * context + context - 1).to(device),
        block_tables=tables.to(device),
        seq_lens=torch.full((batch,), context, dtype=torch.int64, device=device),
        max_decode_seq_len=context,
        prefill_starts=(),
        prefill_query_lens=(),
        prefill_seq_lens=(),
    )
    positions = torch.full((batch,), context - 1, dtype=torch.int64, device=device)
    return ids.to(device), positions, meta


def measure_modes(
    model: LlamaForCausalLM,
    core: AttentionCore,
    service: FfnService,
    cas: CasExchange,
    block_size: int,
    device: torch.device,
    batches: Sequence[int] = BATCHES,
    repeats: int = REPEATS,
) -> ModeProfile:
    """Time WaS and CaS decode steps on every rank at once (a collective: every rank of the
    group calls it together, with the housekeeper running); leaves the service in WaS with a
    fresh prefetch window and zeroed figures."""
    cfg = model.config
    dtype = next(model.parameters()).dtype
    spec = KVCacheSpec(cfg.num_layers, model.num_kv_heads, cfg.head_dim, block_size, dtype)
    kv = allocate_kv_cache(spec, max(batches) * CONTEXT_BLOCKS, device)
    dp = cas.own.dp
    times: dict[tuple[int, int], list[float]] = {}
    whole = dist.group.WORLD if dist.is_initialized() else None
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first round warms up, untimed
            for b in batches:
                ids, positions, meta = _decode_step(b, block_size, cfg.vocab_size, device)
                for mode in (Mode.WAS, Mode.CAS):
                    service.set_mode(mode)
                    if mode == Mode.CAS:
                        cas.begin_step([b] * dp)
                    if whole is not None:
                        dist.barrier()  # the replicas step together, as in a job's tail
                    start = time.perf_counter()
                    model.forward(ids, positions, kv, meta, core)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    times.setdefault((int(mode), b), []).append(time.perf_counter() - start)
    service.set_mode(Mode.WAS)
    service.housekeeper.reset()  # a fresh window and figures for the first real step
    service.housekeeper.stats = WasStats()
    cas.stats = CasStats()
    service.fused_layers = 0
    keys = sorted(times)
    mine = torch.tensor([statistics.median(times[k][1:]) * 1e3 for k in keys], dtype=torch.float64)
    if whole is not None:
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    ms = dict(zip(keys, mine.tolist(), strict=True))
    return ModeProfile(
        {b: ms[(int(Mode.WAS), b)] for b in batches},
        {b: ms[(int(Mode.CAS), b)] for b in batches},
        SOURCE_MEASURED,
    )
