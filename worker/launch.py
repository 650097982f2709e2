"""Start a worker group: one process per rank, on one host or across pods.

Rank 0 is the leader: it hosts the rendezvous store (on an OS-picked port when running alone),
runs the scheduler, and returns an ``LLMEngine`` whose executor drives every rank. Other ranks
load their shards and follow the leader's plans. Across pods, global rank = node rank x ranks
per node + local rank, with the address, port and sizes the operator puts in the environment.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gearshift.worker.attention.select import make_attention
from gearshift.worker.config import EngineConfig
from gearshift.worker.engine.llm_engine import LLMEngine
from gearshift.worker.engine.loading import ModelSpec, inspect_model, kv_cache_blocks
from gearshift.worker.engine.model_runner import ModelRunner, StepThreads
from gearshift.worker.errors import GroupFailure, InvalidRequestError
from gearshift.worker.kv.block_manager import BlockManager
from gearshift.worker.kv.cache import KVCacheSpec, allocate_kv_cache
from gearshift.worker.model.weights import open_weight_source
from gearshift.worker.parallel.control import ControlChannel
from gearshift.worker.parallel.executor import GroupExecutor, follow
from gearshift.worker.parallel.gears import build_gears
from gearshift.worker.parallel.groups import GroupSet, create_groups
from gearshift.worker.parallel.layout import Layout
from gearshift.worker.parallel.watchdog import EXIT_PEER_FAILED, Watchdog
from gearshift.worker.policies.base import GearPolicy, StaticPolicy
from gearshift.worker.policies.shift import DEFAULT_THRESHOLD, ShiftPolicy
from gearshift.worker.tokenizer.tokenizer import Tokenizer

log = logging.getLogger(__name__)

POLICIES = ("static", "shift")
_ENV = {
    "group_addr": "GEARSHIFT_GROUP_ADDR",
    "group_port": "GEARSHIFT_GROUP_PORT",
    "world_size": "GEARSHIFT_GROUP_SIZE",
    "node_rank": "GEARSHIFT_NODE_RANK",
    "ranks_per_node": "GEARSHIFT_RANKS_PER_NODE",
}


@dataclass(frozen=True)
class ParallelConfig:
    """The group's layout and policy, and where its ranks meet."""

    policy: str = "static"
    tp: int = 1
    sp: int = 1
    shift_threshold: int = DEFAULT_THRESHOLD
    group_addr: str = "127.0.0.1"
    group_port: int = 0  # 0: the leader picks a free port (all ranks on this host)
    node_rank: int = 0
    ranks_per_node: int = 0  # 0: every rank on this host
    timeout_s: float = 120.0  # every collective and the rendezvous
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 20.0
    threads_per_rank: int = 0  # 0: this host's cores shared evenly between its ranks
    # CPU: pin each of this host's ranks to its own cores when together they use exactly the
    # cores this process may run on (bind_rank_cores).
    cpu_bind: bool = True

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise InvalidRequestError(
                "policy", f"policy {self.policy!r} is not one of {', '.join(POLICIES)}"
            )
        Layout(self.sp, self.tp)
        if self.ranks_per_node and self.world_size % self.ranks_per_node:
            raise InvalidRequestError(
                "ranks_per_node",
                f"world size {self.world_size} is not a multiple of {self.ranks_per_node}",
            )
        if self.group_port == 0 and self.local_ranks != self.world_size:
            raise InvalidRequestError(
                "group_port", "a group spanning hosts needs an explicit group port"
            )

    @property
    def layout(self) -> Layout:
        return Layout(self.sp, self.tp)

    @property
    def world_size(self) -> int:
        return self.sp * self.tp

    @property
    def local_ranks(self) -> int:
        return self.ranks_per_node or self.world_size

    def make_policy(self) -> GearPolicy:
        if self.policy == "shift":
            return ShiftPolicy(self.sp, self.tp, self.shift_threshold)
        return StaticPolicy(tp=self.tp, sp=self.sp)

    def with_environment(self, env: dict[str, str] | None = None) -> ParallelConfig:
        """Fill the rendezvous from the variables the operator sets on every worker pod."""
        env = dict(os.environ if env is None else env)
        changes: dict[str, Any] = {}
        if _ENV["group_addr"] in env:
            changes["group_addr"] = env[_ENV["group_addr"]]
        for name in ("group_port", "node_rank", "ranks_per_node"):
            if _ENV[name] in env:
                changes[name] = int(env[_ENV[name]])
        if _ENV["world_size"] in env and int(env[_ENV["world_size"]]) != self.world_size:
            raise InvalidRequestError(
                "world_size",
                f"{_ENV['world_size']}={env[_ENV['world_size']]} but sp x tp = {self.world_size}",
            )
        return replace(self, **changes)


@dataclass
class RankState:
    """What one rank holds once it has joined its group."""

    spec: ModelSpec
    runner: ModelRunner
    groups: GroupSet
    num_blocks: int
    watchdog: Watchdog | None = None
    channel: ControlChannel | None = None
    children: list[Any] = field(default_factory=list)


def _device(config: EngineConfig, local_rank: int) -> torch.device:
    if config.device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device(config.device)


def _setup_rank(
    config: EngineConfig, parallel: ParallelConfig, groups: GroupSet, device: torch.device
) -> RankState:
    """Load this rank's gears and allocate its KV cache (same block count on every rank)."""
    spec, source = inspect_model(config, device)
    source.close()
    cfg = spec.config
    gears = build_gears(
        parallel.policy,
        parallel.layout,
        groups,
        spec,
        lambda: open_weight_source(spec.path),
        make_attention(config, cfg.head_dim),
        device,
        show_progress=config.show_progress and groups.world.rank == 0,
    )
    kv_heads = parallel.layout.kv_heads_per_rank(cfg.num_kv_heads)
    kv_spec = KVCacheSpec(cfg.num_layers, kv_heads, cfg.head_dim, config.block_size, spec.dtype)
    blocks = kv_cache_blocks(config, kv_spec, device, spec.max_model_len)
    if groups.world.size > 1:
        agreed = torch.tensor([blocks], dtype=torch.int64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        blocks = int(agreed.item())
    kv = allocate_kv_cache(kv_spec, blocks, device)
    threads = None
    if device.type == "cpu" and config.prefill_threads is not None:
        threads = StepThreads(config.prefill_threads)
    return RankState(spec, ModelRunner(gears, kv, device, threads), groups, blocks)


def _join_group(
    config: EngineConfig, parallel: ParallelConfig, rank: int, store: dist.TCPStore, port: int
) -> RankState:
    local_rank = rank % parallel.local_ranks
    device = _device(config, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=parallel.timeout_s)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=parallel.world_size, timeout=timeout
    )
    spec, source = inspect_model(config, device)
    source.close()
    groups = create_groups(parallel.layout, rank, spec.config.num_kv_heads, timeout)
    watchdog = Watchdog(
        parallel.group_addr,
        port,
        rank,
        parallel.world_size,
        parallel.heartbeat_interval_s,
        parallel.heartbeat_timeout_s,
        startup_timeout=parallel.timeout_s,
    ).start()
    try:
        state = _setup_rank(config, parallel, groups, device)
    except Exception as exc:
        watchdog.record_exit(f"{type(exc).__name__}: {exc}")
        raise
    watchdog.mark_ready()
    state.watchdog = watchdog
    state.channel = ControlChannel(
        groups.control, keepalive_interval=min(5.0, parallel.timeout_s / 4)
    )
    return state


def _set_threads(config: EngineConfig, parallel: ParallelConfig) -> None:
    if config.device != "cpu":
        return
    tune_host_allocator()
    threads = parallel.threads_per_rank or max(1, (os.cpu_count() or 1) // parallel.local_ranks)
    torch.set_num_threads(config.num_threads or threads)


def bind_rank_cores(
    config: EngineConfig, parallel: ParallelConfig, local_rank: int, cores: Sequence[int]
) -> set[int] | None:
    """Pin this process (a CPU rank) to its share of ``cores`` (the cores the host's launcher
    may use), like vLLM's OpenMP thread binding; returns the affinity it replaced, or None.

    Only when this host's ranks times their threads are exactly ``cores``: a group that owns
    the machine. Unpinned ranks migrate between cores and each gloo collective (~0.6 ms on a
    2-core VM) waits for the slowest; pinned, two runs of one step differ by under 5% instead
    of up to 10% (benchmarks/shift_envelope.py). Groups sharing a host (``gearshift serve
    --groups``) get fewer threads than cores and stay unpinned, as does one rank alone.
    """
    if (
        config.device != "cpu"
        or not parallel.cpu_bind
        or parallel.world_size == 1
        or not hasattr(os, "sched_setaffinity")
    ):
        return None
    threads = torch.get_num_threads()
    if threads * parallel.local_ranks != len(cores):
        return None
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, sorted(cores)[local_rank * threads : (local_rank + 1) * threads])
    return before


# glibc's allocator returns freed blocks over its (dynamic) mmap threshold to the kernel, and the
# next step maps them again: a prefill step's activations (megabytes each) then page-fault and get
# zeroed on every use (x + y on two 12 MB bf16 tensors: 5 ms instead of 1.8 ms). Keeping blocks up
# to 32 MiB (glibc's maximum) on the heap, and 1 GiB of free heap before trimming, makes steady
# steps reuse warm memory, as the caching allocators of GPU backends do.
_MMAP_THRESHOLD = 32 << 20
_TRIM_THRESHOLD = 1 << 30


def tune_host_allocator() -> bool:
    """Keep large freed blocks in this process's heap (glibc only); True if it took effect."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
        return bool(
            libc.mallopt(m_mmap_threshold, _MMAP_THRESHOLD)
            and libc.mallopt(m_trim_threshold, _TRIM_THRESHOLD)
        )
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False


def _die_with_parent() -> None:
    # A follower spawned by a local leader must not outlive it, even if the leader is killed.
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def follower_main(
    config: EngineConfig,
    parallel: ParallelConfig,
    rank: int,
    port: int,
    orphan_guard: bool,
    cores: Sequence[int] = (),
) -> None:
    """Entry point of a non-leader rank (spawned locally or started by ``run_node``)."""
    if orphan_guard:
        _die_with_parent()
    logging.basicConfig(
        level=logging.WARNING, format=f"rank {rank} %(levelname)s %(name)s: %(message)s"
    )
    _set_threads(config, parallel)
    bind_rank_cores(config, parallel, rank % parallel.local_ranks, cores)
    timeout = timedelta(seconds=parallel.timeout_s)
    state: RankState | None = None
    try:
        store = dist.TCPStore(
            parallel.group_addr, port, parallel.world_size, is_master=False, timeout=timeout
        )
        state = _join_group(config, parallel, rank, store, port)
        assert state.channel is not None and state.watchdog is not None
        follow(state.runner, state.channel, state.watchdog)
    except GroupFailure as exc:
        print(f"gearshift worker group: {exc}", file=sys.stderr, flush=True)
        os._exit(EXIT_PEER_FAILED)
    except Exception as exc:  # noqa: BLE001 - any failure ends this rank, loudly, and tells peers
        traceback.print_exc()
        if state is not None and state.watchdog is not None:
            state.watchdog.record_exit(f"{type(exc).__name__}: {exc}")
        print(f"gearshift worker group: rank {rank} failed: {exc}", file=sys.stderr, flush=True)
        os._exit(1)


def _usable_cores() -> list[int]:
    """The cores this process may run on (its cgroup's cpuset in a pod)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _spawn_followers(
    config: EngineConfig, parallel: ParallelConfig, ranks: range, port: int, orphan_guard: bool
) -> list[Any]:
    ctx = mp.get_context("spawn")
    cores = _usable_cores()  # before the leader pins itself: every rank splits the same set
    procs = []
    for rank in ranks:
        proc = ctx.Process(
            target=follower_main,
            args=(config, parallel, rank, port, orphan_guard, cores),
            name=f"gearshift-rank-{rank}",
            daemon=True,
        )
        proc.start()
        procs.append(proc)
    return procs


def stop_processes(procs: list[Any], timeout: float = 30.0) -> None:
    """Wait for ranks to finish, then kill what is left; nothing outlives the group."""
    for proc in procs:
        proc.join(timeout)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def _tokenizer(config: EngineConfig, spec: ModelSpec) -> Tokenizer | None:
    return None if config.skip_tokenizer_init else Tokenizer.from_path(spec.path)


def _engine(
    config: EngineConfig, parallel: ParallelConfig, state: RankState, executor: Any
) -> LLMEngine:
    spec = state.spec
    tokenizer = _tokenizer(config, spec)
    blocks = BlockManager(
        state.num_blocks,
        config.block_size,
        config.max_num_seqs,
        -(-spec.max_model_len // config.block_size),
        config.enable_prefix_caching,
    )
    eos = frozenset(spec.config.eos_token_ids) | (
        tokenizer.eos_token_ids if tokenizer else frozenset()
    )
    return LLMEngine(
        config,
        executor,
        blocks,
        spec.max_model_len,
        spec.config.vocab_size,
        eos,
        tokenizer,
        policy=parallel.make_policy(),
    )


def start_engine(config: EngineConfig, parallel: ParallelConfig | None = None) -> LLMEngine:
    """The leader's engine for ``parallel``'s layout; spawns this host's other ranks."""
    parallel = parallel or ParallelConfig()
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    if parallel.world_size == 1:
        if config.device == "cpu":
            tune_host_allocator()
        started = time.monotonic()
        device = _device(config, 0)
        state = _setup_rank(config, parallel, GroupSet.single(), device)
        engine = _engine(config, parallel, state, state.runner)
        log.info("engine ready in %.1fs: %s", time.monotonic() - started, state.spec.path.name)
        return engine
    if parallel.node_rank != 0:
        raise InvalidRequestError(
            "node_rank", "only node 0 hosts the leader; other nodes run run_node"
        )
    _set_threads(config, parallel)
    timeout = timedelta(seconds=parallel.timeout_s)
    store = dist.TCPStore(
        parallel.group_addr,
        parallel.group_port,
        parallel.world_size,
        is_master=True,
        timeout=timeout,
        wait_for_workers=False,
    )
    port = int(store.port)
    orphan_guard = parallel.local_ranks == parallel.world_size
    cores = _usable_cores()
    children = _spawn_followers(
        config, parallel, range(1, parallel.local_ranks), port, orphan_guard
    )
    # The leader is this (caller's) process: its old affinity comes back at shutdown.
    previous = bind_rank_cores(config, parallel, 0, cores)

    def restore() -> None:
        if previous is not None:
            os.sched_setaffinity(0, previous)

    try:
        state = _join_group(config, parallel, 0, store, port)
    except BaseException:
        for proc in children:
            proc.kill()
        stop_processes(children, timeout=5)
        restore()
        raise
    assert state.channel is not None and state.watchdog is not None
    executor = GroupExecutor(
        state.runner, state.channel, state.watchdog, children, store, on_shutdown=restore
    )
    return _engine(config, parallel, state, executor)


def run_node(config: EngineConfig, parallel: ParallelConfig) -> int:
    """A non-leader pod: run its ranks until the group ends; the first failing exit code wins."""
    first = parallel.node_rank * parallel.local_ranks
    procs = _spawn_followers(
        config, parallel, range(first, first + parallel.local_ranks), parallel.group_port, False
    )
    codes = []
    for proc in procs:
        proc.join()
        codes.append(proc.exitcode or 0)
    return next((c for c in codes if c), 0)
