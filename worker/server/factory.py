"""Builds the group leader's engine for a worker process: the one call that starts a group.

The policy in engine.json (the proto) goes to the registry, which returns the running policy;
`start_engine` returns the leader's engine (spawning this host's other ranks). The rendezvous
comes from the pod's environment. A non-leader pod's ranks are its group runtime's
(``runtimes.run_follower_node``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, replace

from gearshift.worker.config import EngineConfig
from gearshift.worker.engine.llm_engine import LLMEngine
from gearshift.worker.launch import GroupConfig, start_engine
from gearshift.worker.policies.base import Policy
from gearshift.worker.policies.registry import make_policy
from gearshift.worker.server.settings import WorkerSettings


def group_config(
    policy: Policy,
    env: Mapping[str, str] | None = None,
    heartbeat_timeout_s: float | None = None,
    control_token: str | None = None,
) -> GroupConfig:
    """The rendezvous for ``policy``'s ranks, from the pod's environment; ``control_token``
    authenticates the group's own listeners (None: ``--insecure-no-auth``)."""
    group = GroupConfig(control_token=control_token)
    if heartbeat_timeout_s is not None:
        # Heartbeats several times per timeout, so one late beat is not a verdict.
        group = replace(
            group,
            heartbeat_timeout_s=heartbeat_timeout_s,
            heartbeat_interval_s=min(group.heartbeat_interval_s, heartbeat_timeout_s / 5),
        )
    return group.with_environment(policy.world_size, dict(os.environ if env is None else env))


def engine_config(settings: WorkerSettings) -> EngineConfig:
    # The router detokenises; the worker keeps the tokenizer for its EOS ids.
    return EngineConfig(model=settings.model, detokenize=False, **asdict(settings.engine))


def build_engine(settings: WorkerSettings) -> LLMEngine:
    """The leader's engine: model, KV cache and policy, every rank of the group joined."""
    policy = make_policy(settings.policy, settings.ranks)
    group = group_config(policy, heartbeat_timeout_s=settings.heartbeat_timeout_s)
    return start_engine(engine_config(settings), policy, group)
