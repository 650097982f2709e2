"""Which of a rank's gears replay decode steps from graphs, what their memory costs before the KV
cache is sized, and their capture once it is (engine/graph_runner has the mechanism).

On CUDA a captured step holds its collectives, so graphs need capturable ones: NCCL's are, gloo's
are not, and ranks that share one GPU over gloo (``device: cuda:N``, ``comm.via_host``) stay eager
(said in a log line). A gear with a pipeline stage stays eager (its activations cross by sends the
leader keeps several micro-batches of in flight), and a policy may keep gears eager with a reason
(``RankModel.graph_gears``, ``graph_note``). ``enforce_eager`` (vLLM's flag) turns graphs off.
Off CUDA graphs run only when ``graphs_on_cpu`` asks (tests): the same bookkeeping, capture
replaced by direct calls.

Memory, counted before the KV cache is sized: the static inputs are allocated first (so the free
memory the cache is sized from no longer holds them), and the graphs' pool is measured by running
each gear's largest bucket once over a one-block cache: its peak allocation, plus a margin, is
kept out of the cache's budget. The pool the capture really takes is logged next to it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gearshift.worker.config import EngineConfig
from gearshift.worker.engine.graph_runner import DecodeGraphs, StaticInputs, bucket_sizes
from gearshift.worker.engine.model_runner import Gear, ModelRunner
from gearshift.worker.kv.cache import KVCacheSpec, LayerKV, allocate_kv_cache
from gearshift.worker.policies.base import Policy, RankModel

log = logging.getLogger(__name__)

# The measured peak of one step is what the pool holds; allocator rounding and the graphs of the
# smaller buckets (which reuse the pool's blocks) take a little more.
POOL_MARGIN = 0.1
POOL_SLACK_BYTES = 32 << 20


@dataclass
class GraphSetup:
    """A rank's decode graphs before capture, and the pool memory kept from the KV cache."""

    graphs: DecodeGraphs
    cuda: bool
    pool_estimate: int  # bytes; 0 off CUDA


def eager_reason(config: EngineConfig, device: torch.device, world_size: int) -> str | None:
    """Why this rank runs every step eagerly, or None when graphs may run."""
    if config.enforce_eager:
        return "enforce_eager"
    if device.type != "cuda":
        return None if config.graphs_on_cpu else "graphs are for CUDA (graphs_on_cpu is off)"
    if world_size > 1 and dist.is_initialized() and dist.get_backend() != "nccl":
        return (
            f"the group's collectives run over {dist.get_backend()} (ranks sharing one GPU, "
            f"device {config.device}), which a CUDA graph cannot capture; only NCCL's can"
        )
    return None


def _makes_logits(gear: Gear) -> bool:
    model = gear.model
    return model.lm_head is not None and model.tp.rank == 0 and gear.sp.rank == 0


def plan_graphs(
    config: EngineConfig,
    policy: Policy,
    held: RankModel,
    runner: ModelRunner,
    max_model_len: int,
    rank: int,
) -> GraphSetup | None:
    """The graphs this rank will capture (static inputs allocated, pool measured), or None."""
    device = runner.device
    why = eager_reason(config, device, policy.world_size)
    if why is not None:
        log.info("rank %d runs decode steps eagerly: %s", rank, why)
        return None
    if held.graph_note:
        log.info("rank %d: %s", rank, held.graph_note)
    wanted = range(len(held.gears)) if held.graph_gears is None else held.graph_gears
    largest = min(
        config.max_num_seqs, config.max_num_batched_tokens, config.max_cudagraph_capture_size
    )
    buckets: dict[int, tuple[int, ...]] = {}
    for i in wanted:
        gear = held.gears[i]
        if gear.stage is not None:
            log.info("rank %d: gear %s is pipelined: its steps run eagerly", rank, gear.name)
            continue
        buckets[i] = bucket_sizes(largest, policy.pad_multiple(i))
    if not buckets:
        return None
    logit_gears = [held.gears[i] for i in buckets if _makes_logits(held.gears[i])]
    logits = None
    if logit_gears:
        model = logit_gears[0].model
        logits = (model.config.vocab_size, next(model.parameters()).dtype)
    width = -(-max_model_len // config.block_size)
    top = max(max(b) for b in buckets.values())
    inputs = StaticInputs(top, width, device, logits)
    graphs = DecodeGraphs(inputs, buckets, config.block_size)
    cuda = device.type == "cuda"
    pool = _measure_pool(graphs, held, runner) if cuda else 0
    log.info(
        "rank %d: decode graphs for gears %s, buckets up to %d, tables %d blocks wide: static "
        "inputs %.1f MiB, pool %.1f MiB (measured before the KV cache is sized)",
        rank,
        [held.gears[i].name for i in buckets],
        top,
        width,
        inputs.nbytes / 2**20,
        pool / 2**20,
    )
    return GraphSetup(graphs, cuda, pool)


def _scratch_kv(gear: Gear, block_size: int, device: torch.device) -> list[LayerKV]:
    """A one-block cache shaped like ``gear``'s (every padding row reads block 0)."""
    model = gear.model
    cfg = model.config
    dtype = next(model.parameters()).dtype
    spec = KVCacheSpec(len(model.model.layers), model.num_kv_heads, cfg.head_dim, block_size, dtype)
    return allocate_kv_cache(spec, 1, device)


def _measure_pool(graphs: DecodeGraphs, held: RankModel, runner: ModelRunner) -> int:
    """Peak memory of each gear's largest bucket, run once eagerly: what its graph pool holds."""
    device = runner.device
    peak = 0
    for i, sizes in graphs.buckets.items():
        gear = held.gears[i]
        if held.activate_gear is not None:
            held.activate_gear(i)
        kv = _scratch_kv(gear, graphs.block_size, device)
        n = max(sizes)
        graphs.inputs.pad(n)
        step = graphs.run_fn(runner.forward, gear, kv, n)
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        with torch.inference_mode():  # as steps run (ModelRunner.execute)
            step()
        torch.cuda.synchronize(device)
        peak = max(peak, torch.cuda.max_memory_allocated(device) - before)
        del kv, step
    if held.activate_gear is not None:
        held.activate_gear(0)
    torch.cuda.empty_cache()  # the cache is sized from free memory: return what this used
    return int(peak * (1 + POOL_MARGIN)) + POOL_SLACK_BYTES


def capture_graphs(setup: GraphSetup, held: RankModel, runner: ModelRunner, rank: int) -> None:
    """Capture every planned gear's buckets over the rank's KV cache; the runner replays them."""
    graphs = setup.graphs
    device = runner.device
    reserved = torch.cuda.memory_reserved(device) if setup.cuda else 0
    with torch.inference_mode():
        for i in sorted(graphs.buckets):
            gear = held.gears[i]
            if held.activate_gear is not None:
                held.activate_gear(i)
            kv = held.gear_kv(i) if held.gear_kv is not None else runner.kv_caches
            watched = [t for layer in kv for t in layer] + _weights(gear)
            graphs.capture(i, gear, kv, runner.forward, watched, setup.cuda)
        if held.activate_gear is not None:
            held.activate_gear(0)
    runner.graphs = graphs
    if setup.cuda:
        pool = torch.cuda.memory_reserved(device) - reserved
        log.info(
            "rank %d: captured %d decode graphs; pool %.1f MiB (%.1f MiB kept for it)",
            rank,
            len(graphs.graphs),
            pool / 2**20,
            setup.pool_estimate / 2**20,
        )


def _weights(gear: Gear) -> list[torch.Tensor]:
    seen: set[int] = set()
    out: list[torch.Tensor] = []
    for p in gear.model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
