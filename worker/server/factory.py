"""Builds the group leader's engine for a worker process: the one call that starts a group.

The proto policy (engine.json) becomes the launcher's ParallelConfig; `start_engine` returns the
leader's engine (spawning this host's other ranks), `run_node` runs a non-leader pod's ranks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, replace

from gearshift.v1 import policy_fields, policy_pb2
from gearshift.worker.config import EngineConfig
from gearshift.worker.engine.llm_engine import LLMEngine
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.launch import ParallelConfig, run_node, start_engine
from gearshift.worker.server.settings import WorkerSettings


def parallel_config(
    policy: policy_pb2.Policy,
    env: Mapping[str, str] | None = None,
    heartbeat_timeout_s: float | None = None,
) -> ParallelConfig:
    """The launcher's layout for a defaults-filled policy, rendezvous from the pod's env."""
    kind = policy_fields.kind_of(policy)
    if kind == "static":
        s = policy.static
        for name in ("pp", "dp"):
            if getattr(s, name) != 1:
                raise InvalidRequestError(
                    f"policy.static.{name}", f"policy.static.{name} must be 1 in this engine"
                )
        parallel = ParallelConfig(policy="static", tp=s.tp, sp=s.sp)
    elif kind == "shift":
        s = policy.shift
        parallel = ParallelConfig(policy="shift", tp=s.tp, sp=s.sp, shift_threshold=s.threshold)
    else:
        raise InvalidRequestError("policy", f"policy {kind!r} is not implemented by this worker")
    if heartbeat_timeout_s is not None:
        # Heartbeats several times per timeout, so one late beat is not a verdict.
        parallel = replace(
            parallel,
            heartbeat_timeout_s=heartbeat_timeout_s,
            heartbeat_interval_s=min(parallel.heartbeat_interval_s, heartbeat_timeout_s / 5),
        )
    return parallel.with_environment(dict(os.environ if env is None else env))


def engine_config(settings: WorkerSettings) -> EngineConfig:
    # The router detokenises; the worker keeps the tokenizer for its EOS ids.
    return EngineConfig(model=settings.model, detokenize=False, **asdict(settings.engine))


def build_engine(settings: WorkerSettings) -> LLMEngine:
    """The leader's engine: model, KV cache and policy, every rank of the group joined."""
    return start_engine(
        engine_config(settings),
        parallel_config(settings.policy, heartbeat_timeout_s=settings.heartbeat_timeout_s),
    )


def run_follower_node(settings: WorkerSettings) -> int:
    """A non-leader pod: run its ranks until the group ends; returns the exit code."""
    return run_node(
        engine_config(settings),
        parallel_config(settings.policy, heartbeat_timeout_s=settings.heartbeat_timeout_s),
    )
