"""Group runtimes: how a worker process serves a policy's group, and how a follower pod runs
its ranks, for each shape of group there is.

A policy names the runtime its group needs (``Policy.group_runtime()``): ``"engine"`` (one
engine led by rank 0) and ``"replicas"`` (``engine_replicas() > 1``) by default, its own name
otherwise (``"tetris"``: a prefill pool and decode instances). ``RUNTIMES`` maps each name to a
``GroupRuntime``; the server (``app.py``) and a follower pod (``run_follower_node``) look the
name up here and never look at the policy's kind.

Why a name on the policy and a table here, not the policy handing out its endpoint (as
``group_handle``/``node_runner`` did) nor a registry that runtime packages fill on import: a
runtime starts processes and serves gRPC, which sits above every policy (DESIGN.md's floors), so a
policy that returned its runtime had to import upward, through function-local imports that hid
a package cycle (policies → tetris → launch/server → policies.registry). A registry filled on
import would be hidden module-level state whose content depends on what happened to be
imported. A table that imports every runtime is explicit, has no cycle, and refuses an unknown
name naming the policy. Adding a runtime is one module (or package) and one line here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from gearshift.worker.config import EngineConfig
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.launch import GroupConfig, run_node
from gearshift.worker.launch.tetris.start import run_tetris_node
from gearshift.worker.policies.base import ENGINE_RUNTIME, REPLICAS_RUNTIME, Policy
from gearshift.worker.policies.registry import make_policy
from gearshift.worker.policies.tetris.policy import TETRIS_RUNTIME
from gearshift.worker.server.engine_process import ProcessEngine
from gearshift.worker.server.factory import engine_config, group_config
from gearshift.worker.server.handle import EngineHandle
from gearshift.worker.server.replica_engine import ReplicaGroupEngine
from gearshift.worker.server.settings import WorkerSettings
from gearshift.worker.server.tetris_engine import TetrisGroupEngine


class GroupEndpoint(EngineHandle, Protocol):
    """The EngineHandle of a group leader's worker process, which starts and stops it."""

    async def start(self) -> None:
        """Start the group; EngineStartError when it cannot serve."""
        ...

    async def stop(self, timeout_s: float = 15.0) -> None: ...


class GroupRuntime(Protocol):
    """What starts and serves one shape of worker group."""

    def endpoint(self, settings: WorkerSettings) -> GroupEndpoint:
        """The group leader's EngineHandle (not started: the server awaits its ``start``)."""
        ...

    def run_node(self, config: EngineConfig, policy: Policy, group: GroupConfig) -> int:
        """A non-leader pod's ranks, until the group ends; the process's exit code."""
        ...


@dataclass(frozen=True)
class Runtime:
    """A ``GroupRuntime`` from its endpoint class and its follower pod's entry point."""

    make_endpoint: Callable[[WorkerSettings], GroupEndpoint]
    node: Callable[[EngineConfig, Policy, GroupConfig], int]

    def endpoint(self, settings: WorkerSettings) -> GroupEndpoint:
        return self.make_endpoint(settings)

    def run_node(self, config: EngineConfig, policy: Policy, group: GroupConfig) -> int:
        return self.node(config, policy, group)


RUNTIMES: Mapping[str, GroupRuntime] = {
    ENGINE_RUNTIME: Runtime(ProcessEngine, run_node),
    REPLICAS_RUNTIME: Runtime(ReplicaGroupEngine, run_node),
    TETRIS_RUNTIME: Runtime(TetrisGroupEngine, run_tetris_node),
}


def runtime_for(policy: Policy) -> GroupRuntime:
    """The runtime ``policy`` names; InvalidRequestError naming the policy for an unknown one."""
    name = policy.group_runtime()
    runtime = RUNTIMES.get(name)
    if runtime is None:
        raise InvalidRequestError(
            f"policy.{policy.kind}",
            f"policy {policy.kind!r} needs the group runtime {name!r}, which this worker does "
            f"not have (it has {sorted(RUNTIMES)})",
        )
    return runtime


def run_group_node(config: EngineConfig, policy: Policy, group: GroupConfig) -> int:
    """A non-leader pod of ``policy``'s group, whatever its shape: its runtime's ranks."""
    return runtime_for(policy).run_node(config, policy, group)


def run_follower_node(settings: WorkerSettings) -> int:
    """``gearshift worker`` on a non-leader pod: run its ranks until the group ends; returns the
    exit code."""
    policy = make_policy(settings.policy, settings.ranks)
    group = group_config(
        policy,
        heartbeat_timeout_s=settings.heartbeat_timeout_s,
        control_token=settings.control_token,
    )
    return run_group_node(engine_config(settings), policy, group)
