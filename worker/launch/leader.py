"""Start a worker group: one process per rank, on one host or across pods.

Rank 0 is the leader: it hosts the rendezvous store (on an OS-picked port when running alone),
runs the scheduler, and returns an ``LLMEngine`` whose executor drives every rank. Other ranks
load their shards and follow the leader's plans. Across pods, global rank = node rank x ranks
per node + local rank, with the address, port and sizes the operator puts in the environment.
What each rank computes is the policy's (``Policy.build_rank``); this module only places ranks.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch

from gearshift.v1 import policy_pb2
from gearshift.worker.config import EngineConfig
from gearshift.worker.engine.executor import GroupExecutor
from gearshift.worker.engine.llm_engine import LLMEngine
from gearshift.worker.engine.loading import inspect_model
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.kv.block_manager import BlockManager
from gearshift.worker.launch.group_config import GroupConfig
from gearshift.worker.launch.host import (
    bind_rank_cores,
    set_threads,
    tune_host_allocator,
    usable_cores,
)
from gearshift.worker.launch.processes import spawn_followers, stop_processes
from gearshift.worker.launch.rank import (
    RankState,
    check_comm_rules,
    device_for,
    join_group,
    setup_rank,
)
from gearshift.worker.policies.base import ENGINE_RUNTIME, Policy
from gearshift.worker.policies.registry import make_policy
from gearshift.worker.tokenizer.tokenizer import Tokenizer

log = logging.getLogger(__name__)

PolicyLike = Policy | policy_pb2.Policy | Mapping[str, Any] | str | None


def _policy(policy: PolicyLike) -> Policy:
    return policy if isinstance(policy, Policy) else make_policy(policy)


def leader_engine(
    config: EngineConfig, policy: Policy, state: RankState, executor: Any
) -> LLMEngine:
    """The engine an (instance or replica) leader runs over its joined rank: tokenizer, KV
    blocks, scheduler and sampler, stepping through ``executor``."""
    spec = state.spec
    tokenizer = None if config.skip_tokenizer_init else Tokenizer.from_path(spec.path)
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
    engine = LLMEngine(
        config,
        executor,
        blocks,
        spec.max_model_len,
        spec.config.vocab_size,
        eos,
        tokenizer,
        policy=policy,
    )
    if isinstance(executor, GroupExecutor):
        executor.phases = engine.phases  # the plan's broadcast is one of the step's phases
    return engine


def one_rank_engine(config: EngineConfig, policy: Policy, state: RankState) -> LLMEngine:
    """The engine over a one-rank group's state (``rank.finish_rank``'s): its runner executes."""
    return leader_engine(config, policy, state, state.runner)


def check_group(config: EngineConfig, policy: Policy, group: GroupConfig) -> None:
    """Refuse a layout the model or the hosts cannot take, before any rank starts."""
    group.check(policy.world_size)
    local = group.local_ranks(policy.world_size)
    if policy.single_node and local < policy.world_size:
        raise InvalidRequestError(
            "ranks_per_node",
            f"the {policy.kind} policy runs every rank on one host; ranks_per_node "
            f"{local} < {policy.world_size} ranks",
        )
    policy.check_nodes(policy.world_size // local)
    spec, source = inspect_model(config, torch.device("cpu"))
    source.close()
    policy.check_model(spec.config)


def start_engine(
    config: EngineConfig, policy: PolicyLike = None, group: GroupConfig | None = None
) -> LLMEngine:
    """The leader's engine for ``policy`` (a Policy, the proto, or the CRD's ``spec.policy``
    object; default static on one rank); spawns this host's other ranks."""
    policy = _policy(policy)
    check_comm_rules()
    if policy.engine_replicas() > 1:
        raise InvalidRequestError(
            f"policy.{policy.kind}",
            f"policy {policy.kind!r} forms {policy.engine_replicas()} engine replicas: start it "
            "with launch.replicas.start_replicas",
        )
    if policy.group_runtime() != ENGINE_RUNTIME:
        raise InvalidRequestError(
            f"policy.{policy.kind}",
            f"policy {policy.kind!r} runs as a {policy.group_runtime()!r} group, not one engine: "
            "start it through its group runtime (server/runtimes.py)",
        )
    group = group or GroupConfig()
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    world = policy.world_size
    if world == 1:
        if config.device == "cpu":
            tune_host_allocator()
        started = time.monotonic()
        state = setup_rank(
            config, policy, 0, device_for(config, 0), timedelta(seconds=group.timeout_s)
        )
        engine = leader_engine(config, policy, state, state.runner)
        log.info("engine ready in %.1fs: %s", time.monotonic() - started, state.spec.path.name)
        return engine
    check_group(config, policy, group)
    if group.node_rank != 0:
        raise InvalidRequestError(
            "node_rank", "only node 0 hosts the leader; other nodes run run_node"
        )
    set_threads(config, group, world)
    store = group.host_store(world)
    port = int(store.port)
    local = group.local_ranks(world)
    orphan_guard = local == world
    cores = usable_cores()
    children = spawn_followers(
        config, policy, group, range(1, local), port, orphan_guard, leader_here=True
    )
    # The leader is this (caller's) process: its old affinity comes back at shutdown.
    previous = bind_rank_cores(config, group, world, 0, cores)

    def restore() -> None:
        if previous is not None:
            os.sched_setaffinity(0, previous)

    try:
        state = join_group(config, policy, group, 0, store, port)
    except BaseException:
        for proc in children:
            proc.kill()
        stop_processes(children, timeout=5)
        restore()
        raise
    assert state.channel is not None and state.watchdog is not None
    log.info("worker group ready: %s policy, %d ranks (%d on this host)", policy.kind, world, local)
    executor = GroupExecutor(
        state.runner,
        state.channel,
        state.watchdog,
        children,
        store,
        on_shutdown=restore,
        logits_rank=state.model.logits_rank,
        logits_channel=state.model.logits_channel,
        stop_children=stop_processes,
    )
    return leader_engine(config, policy, state, executor)


def run_node(config: EngineConfig, policy: PolicyLike, group: GroupConfig) -> int:
    """A non-leader pod of a group of one engine or of engine replicas: run its ranks (the
    followers of ``build_rank``) until the group ends; the first failing exit code wins."""
    policy = _policy(policy)
    local = group.local_ranks(policy.world_size)
    first = group.node_rank * local
    procs = spawn_followers(
        config, policy, group, range(first, first + local), group.group_port, False
    )
    codes = []
    for proc in procs:
        proc.join()
        codes.append(proc.exitcode or 0)
    return next((c for c in codes if c), 0)


def build_local_engine(config: EngineConfig) -> LLMEngine:
    """Model, tokenizer, KV cache, scheduler and sampler, all in this process (one rank)."""
    return start_engine(config)
