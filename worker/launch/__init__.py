"""Start worker groups: the leader's engine, follower ranks, a non-leader node's ranks."""

from gearshift.worker.launch.group_config import GroupConfig
from gearshift.worker.launch.host import tune_host_allocator
from gearshift.worker.launch.leader import build_local_engine, run_node, start_engine
from gearshift.worker.launch.processes import stop_processes

__all__ = [
    "GroupConfig",
    "build_local_engine",
    "run_node",
    "start_engine",
    "stop_processes",
    "tune_host_allocator",
]
