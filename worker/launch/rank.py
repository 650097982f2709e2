"""One rank joining its group: process groups, the policy's gears, its KV cache, its loop."""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from gearshift.worker.attention.select import make_attention
from gearshift.worker.config import EngineConfig
from gearshift.worker.engine.control import ControlChannel
from gearshift.worker.engine.device_memory import DeviceLedger
from gearshift.worker.engine.executor import follow
from gearshift.worker.engine.loading import ModelSpec, inspect_model, kv_cache_blocks
from gearshift.worker.engine.model_runner import ModelRunner, StepThreads
from gearshift.worker.errors import GroupFailure, InvalidRequestError
from gearshift.worker.kv.cache import KVCacheSpec, allocate_kv_cache
from gearshift.worker.launch.group_config import GroupConfig
from gearshift.worker.launch.host import bind_rank_cores, die_with_parent, set_threads
from gearshift.worker.launch.rank_graphs import capture_graphs, plan_graphs
from gearshift.worker.model import fused_ops
from gearshift.worker.model.weights import open_weight_source
from gearshift.worker.p2p import COMM_RULES_ENV, comm_rules, start_rules
from gearshift.worker.parallel.groups import create_control_group
from gearshift.worker.parallel.watchdog import EXIT_PEER_FAILED, Watchdog
from gearshift.worker.policies.base import Policy, RankContext, RankModel
from gearshift.worker.shm_segments import hard_exit

log = logging.getLogger(__name__)

STEP_TRACE_ENV = "GEARSHIFT_STEP_TRACE"  # a folder: every rank logs its step events there
# 1: on an NCCL error or timeout, abort the communicators and end the process (torch's default,
# 3, ends it without aborting them).
NCCL_ERROR_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


@dataclass
class RankState:
    """What one rank holds once it has joined its group."""

    spec: ModelSpec
    runner: ModelRunner
    model: RankModel
    num_blocks: int
    watchdog: Watchdog | None = None
    channel: ControlChannel | None = None


def gpu_index(config: EngineConfig, local_rank: int) -> int | None:
    """The GPU local rank ``local_rank`` runs on (None off CUDA); a GPU this host does not show
    is refused naming ``device`` (a launcher may ask before it starts any rank)."""
    if not config.device.startswith("cuda"):
        return None
    pinned = torch.device(config.device).index
    index = local_rank if pinned is None else pinned
    count = torch.cuda.device_count()
    if index >= count:
        raise InvalidRequestError(
            "device",
            f"device {config.device}: local rank {local_rank} needs GPU {index}, but this "
            f"host shows {count}",
        )
    return index


def device_for(config: EngineConfig, local_rank: int) -> torch.device:
    """``cuda``: local rank i on GPU i; ``cuda:N``: every rank of the host on GPU N (ranks then
    share it, and the group runs over gloo, since NCCL refuses two ranks on one device)."""
    index = gpu_index(config, local_rank)
    if index is not None:
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device(config.device)


def group_backend(config: EngineConfig, device: torch.device) -> str:
    """NCCL for one GPU per rank; gloo on CPU and for ranks pinned to one shared GPU."""
    shared = torch.device(config.device).index is not None
    return "nccl" if device.type == "cuda" and not shared else "gloo"


def check_comm_rules() -> None:
    """GEARSHIFT_COMM_RULES must name a rule set before any rank starts (launchers call this)."""
    try:
        comm_rules()
    except ValueError as exc:
        raise InvalidRequestError(COMM_RULES_ENV, str(exc)) from exc


def init_process_group(
    backend: str,
    store: dist.TCPStore,
    rank: int,
    world: int,
    timeout: timedelta,
    device: torch.device,
) -> None:
    """Join the group under the point-to-point rules (GEARSHIFT_COMM_RULES, refused at start
    when unknown). On NCCL a dead peer must end the group within ``timeout``: the watchdog
    aborts the communicators and the process (``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``, unless the
    pod sets it), and ``device_id`` forms the communicators now, so a batch of point-to-point
    operations never is a group's first operation."""
    start_rules()
    if backend == "nccl":
        os.environ.setdefault(NCCL_ERROR_HANDLING_ENV, "1")
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world, timeout=timeout, device_id=device
        )
        return
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def setup_rank(
    config: EngineConfig,
    policy: Policy,
    rank: int,
    device: torch.device,
    timeout: timedelta,
) -> RankState:
    """Build this rank's gears (the policy's) and its KV cache (same block count everywhere)."""
    spec, source = inspect_model(config, device)
    source.close()
    cfg = spec.config
    ctx = RankContext(
        rank=rank,
        world_size=policy.world_size,
        spec=spec,
        open_source=lambda: open_weight_source(spec.path),
        make_core=lambda: make_attention(config, cfg.head_dim),
        device=device,
        timeout=timeout,
        show_progress=config.show_progress and rank == 0,
        block_size=config.block_size,
        ledger=DeviceLedger(device),
    )
    held = policy.build_rank(ctx)
    if device.type == "cuda":
        # What the build freed (e.g. Seesaw's stashed gears) goes back before the KV cache is
        # sized from the device's free memory.
        torch.cuda.empty_cache()
    return finish_rank(config, policy, held, spec, device, rank, ctx.ledger)


def finish_rank(
    config: EngineConfig,
    policy: Policy,
    held: RankModel,
    spec: ModelSpec,
    device: torch.device,
    rank: int,
    ledger: DeviceLedger | None = None,
) -> RankState:
    """What follows a rank's gears: fused kernels, graphs' memory, the KV cache (its block count
    agreed over the group), the runner and its graphs. Benchmarks pass models they built."""
    cfg = spec.config
    choose_fused_ops(config, held, rank)
    threads = None
    if device.type == "cpu" and config.prefill_threads is not None:
        threads = StepThreads(config.prefill_threads)
    runner = ModelRunner(held.gears, [], device, threads, held.hook)
    runner.closers = list(held.closers)
    # Graphs' static inputs and pool come out of the memory before the KV cache is sized.
    graphs = plan_graphs(config, policy, held, runner, spec.max_model_len, rank)
    kv_spec = KVCacheSpec(
        held.kv_layers, held.kv_heads, cfg.head_dim, config.block_size, spec.dtype
    )
    blocks = kv_cache_blocks(
        config,
        kv_spec,
        device,
        spec.max_model_len,
        held.kv_extra_bytes,
        reserve_bytes=graphs.pool_estimate if graphs is not None else 0,
    )
    if policy.world_size > 1:
        on = device if dist.get_backend() == "nccl" else "cpu"
        agreed = torch.tensor([blocks], dtype=torch.int64, device=on)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        blocks = int(agreed.item())
    if held.kv_allocator is not None:
        runner.kv_caches = held.kv_allocator(blocks)
    else:
        runner.kv_caches = allocate_kv_cache(kv_spec, blocks, device)
    if ledger is not None:
        ledger.hold("kv cache", (t for layer in runner.kv_caches for t in layer))
    runner.hook = held.hook  # a policy's allocator may make its hook with the cache
    if graphs is not None:
        capture_graphs(graphs, held, runner, rank)
    trace_dir = os.environ.get(STEP_TRACE_ENV)
    if trace_dir:
        runner.trace = open(Path(trace_dir) / f"rank-{rank}.log", "a", buffering=1)  # noqa: SIM115
    return RankState(spec, runner, held, blocks)


def choose_fused_ops(config: EngineConfig, held: RankModel, rank: int) -> None:
    """CUDA: pick the fused elementwise kernels (measured once, on the first gear's shapes) for
    every gear, before graphs are captured with them; elsewhere nothing changes."""
    tokens = (min(config.max_num_seqs, 256), config.max_num_batched_tokens)
    choice = None
    for gear in held.gears:
        if choice is None:
            choice = fused_ops.choose(config.fused_elementwise, gear.model, tokens, rank)
        if choice is not None:
            fused_ops.apply(gear.model, choice)


def join_group(
    config: EngineConfig,
    policy: Policy,
    group: GroupConfig,
    rank: int,
    store: dist.TCPStore,
    port: int,
) -> RankState:
    """init_process_group, the control channel, heartbeats, then ``setup_rank``."""
    world = policy.world_size
    device = device_for(config, rank % group.local_ranks(world))
    backend = group_backend(config, device)
    timeout = timedelta(seconds=group.timeout_s)
    init_process_group(backend, store, rank, world, timeout, device)
    control = create_control_group(world, rank, timeout)
    watchdog = Watchdog(
        group.group_addr,
        port,
        rank,
        world,
        group.heartbeat_interval_s,
        group.heartbeat_timeout_s,
        startup_timeout=group.timeout_s,
    ).start()
    try:
        state = setup_rank(config, policy, rank, device, timeout)
    except Exception as exc:
        watchdog.record_exit(f"{type(exc).__name__}: {exc}")
        raise
    watchdog.mark_ready()
    state.watchdog = watchdog
    state.channel = ControlChannel(control, keepalive_interval=min(5.0, group.timeout_s / 4))
    return state


def follower_main(
    config: EngineConfig,
    policy: Policy,
    group: GroupConfig,
    rank: int,
    port: int,
    orphan_guard: bool,
    cores: Sequence[int] = (),
    leader_here: bool = False,
) -> None:
    """Entry point of a non-leader rank (spawned locally or started by ``run_node``)."""
    if orphan_guard:
        die_with_parent()
    if leader_here:
        # As in serve's engine process, the leader that started this rank decides when it stops:
        # a terminal's Ctrl-C reaches the whole process group, and a rank that died of it would
        # break the step the leader is in (and print its own traceback).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.WARNING, format=f"rank {rank} %(levelname)s %(name)s: %(message)s"
    )
    world = policy.world_size
    set_threads(config, group, world)
    bind_rank_cores(config, group, world, rank % group.local_ranks(world), cores)
    state: RankState | None = None
    try:
        store = group.join_store(world, port)
        state = join_group(config, policy, group, rank, store, port)
        assert state.channel is not None and state.watchdog is not None
        follow(state.runner, state.channel, state.watchdog)
    except GroupFailure as exc:
        print(f"gearshift worker group: {exc}", file=sys.stderr, flush=True)
        hard_exit(EXIT_PEER_FAILED)
    except Exception as exc:  # noqa: BLE001 - any failure ends this rank, loudly, and tells peers
        traceback.print_exc()
        if state is not None and state.watchdog is not None:
            state.watchdog.record_exit(f"{type(exc).__name__}: {exc}")
        print(f"gearshift worker group: rank {rank} failed: {exc}", file=sys.stderr, flush=True)
        hard_exit(1)
