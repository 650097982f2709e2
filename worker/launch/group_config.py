"""Where a worker group's ranks meet and how they watch each other (not what they compute: that
is the policy's)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

from gearshift.worker.errors import InvalidRequestError

_ENV = {
    "group_addr": "GEARSHIFT_GROUP_ADDR",
    "group_port": "GEARSHIFT_GROUP_PORT",
    "world_size": "GEARSHIFT_GROUP_SIZE",
    "node_rank": "GEARSHIFT_NODE_RANK",
    "ranks_per_node": "GEARSHIFT_RANKS_PER_NODE",
}


@dataclass(frozen=True)
class GroupConfig:
    """Rendezvous, liveness and CPU placement of a group's ranks."""

    group_addr: str = "127.0.0.1"
    group_port: int = 0  # 0: the leader picks a free port (all ranks on this host)
    node_rank: int = 0
    ranks_per_node: int = 0  # 0: every rank on this host
    timeout_s: float = 120.0  # every collective and the rendezvous
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 20.0
    threads_per_rank: int = 0  # 0: this host's cores shared evenly between its ranks
    # CPU: pin each of this host's ranks to its own cores when together they use exactly the
    # cores this process may run on (host.bind_rank_cores).
    cpu_bind: bool = True
    # The deployment's control token (None with --insecure-no-auth): what a group's own
    # listeners authenticate their peers with (Tetris's control listener). Never printed.
    control_token: str | None = field(default=None, repr=False, compare=False)

    def local_ranks(self, world_size: int) -> int:
        return self.ranks_per_node or world_size

    def host_store(self, world_size: int) -> Any:
        """The leader's rendezvous store (a ``torch.distributed.TCPStore``; its ``port`` is the
        one picked when ``group_port`` is 0). Ranks join it with ``join_store``."""
        import torch.distributed as dist

        return dist.TCPStore(
            self.group_addr,
            self.group_port,
            world_size,
            is_master=True,
            timeout=timedelta(seconds=self.timeout_s),
            wait_for_workers=False,
        )

    def join_store(self, world_size: int, port: int) -> Any:
        """A rank's client of the leader's store at ``port``."""
        import torch.distributed as dist

        timeout = timedelta(seconds=self.timeout_s)
        return dist.TCPStore(self.group_addr, port, world_size, is_master=False, timeout=timeout)

    def check(self, world_size: int) -> None:
        """Refuse a rendezvous that cannot hold ``world_size`` ranks, naming the field."""
        if self.ranks_per_node and world_size % self.ranks_per_node:
            raise InvalidRequestError(
                "ranks_per_node",
                f"world size {world_size} is not a multiple of {self.ranks_per_node}",
            )
        if self.group_port == 0 and self.local_ranks(world_size) != world_size:
            raise InvalidRequestError(
                "group_port", "a group spanning hosts needs an explicit group port"
            )

    def with_environment(self, world_size: int, env: dict[str, str] | None = None) -> GroupConfig:
        """Fill the rendezvous from the variables the operator sets on every worker pod."""
        env = dict(os.environ if env is None else env)
        changes: dict[str, Any] = {}
        if _ENV["group_addr"] in env:
            changes["group_addr"] = env[_ENV["group_addr"]]
        for name in ("group_port", "node_rank", "ranks_per_node"):
            if _ENV[name] in env:
                changes[name] = int(env[_ENV[name]])
        if _ENV["world_size"] in env and int(env[_ENV["world_size"]]) != world_size:
            raise InvalidRequestError(
                "world_size",
                f"{_ENV['world_size']}={env[_ENV['world_size']]} but the policy's layout "
                f"uses {world_size} ranks",
            )
        return replace(self, **changes)
