"""This host's share of a CPU group: threads per rank, core pinning, the allocator, orphans."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Sequence

import torch

from gearshift.worker.config import EngineConfig
from gearshift.worker.launch.group_config import GroupConfig


def set_threads(config: EngineConfig, group: GroupConfig, world_size: int) -> None:
    """Torch threads of one CPU rank: this host's cores shared evenly between its ranks."""
    if config.device != "cpu":
        return
    tune_host_allocator()
    local = group.local_ranks(world_size)
    threads = group.threads_per_rank or max(1, (os.cpu_count() or 1) // local)
    torch.set_num_threads(config.num_threads or threads)


def bind_rank_cores(
    config: EngineConfig,
    group: GroupConfig,
    world_size: int,
    local_rank: int,
    cores: Sequence[int],
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
        or not group.cpu_bind
        or world_size == 1
        or not hasattr(os, "sched_setaffinity")
    ):
        return None
    threads = torch.get_num_threads()
    if threads * group.local_ranks(world_size) != len(cores):
        return None
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, sorted(cores)[local_rank * threads : (local_rank + 1) * threads])
    return before


def usable_cores() -> list[int]:
    """The cores this process may run on (its cgroup's cpuset in a pod)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


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


def die_with_parent() -> None:
    """A follower spawned by a local leader must not outlive it, even if the leader is killed."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
