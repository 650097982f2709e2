"""This host's follower ranks as child processes: spawn them, and make sure none outlives the
group."""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch.multiprocessing as mp

from gearshift.worker.config import EngineConfig
from gearshift.worker.launch.group_config import GroupConfig
from gearshift.worker.launch.host import usable_cores
from gearshift.worker.launch.rank import follower_main
from gearshift.worker.policies.base import Policy

# What a rank process imports before it can run anything (torch, the engine, the policies).
_RANK_MODULES = ["gearshift.worker.launch.rank"]


def rank_context() -> Any:
    """The multiprocessing context ranks start from: a fork server that has imported torch and
    the engine once. With plain spawn every rank paid that import (over 2 s of CPU) at every
    group start; a group restarted after a failure, or a process that starts many groups,
    now pays it once. Not fork: the parent may already run threads (gRPC, the engine loop) or
    hold a CUDA context, which a fork must not copy; the fork server is a clean process that
    imported modules and did nothing else."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_RANK_MODULES)
    return ctx


def set_process_name(name: str) -> None:
    """The name ``ps``/``top`` show (Linux comm, 15 bytes): forked ranks would all show the
    fork server's command line, so each says what it is (gs-engine, gs-rank-2, ...)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)  # PR_SET_NAME


def start_in_environment(
    env: dict[str, str], name: str, target: Callable[..., None], *args: Any
) -> None:
    """A process's entry: the fork server's environment is the one it started with, so the
    parent's environment at the time of this start (as spawn would give it) is applied
    before ``target`` runs."""
    os.environ.clear()
    os.environ.update(env)
    set_process_name(name)
    target(*args)


def start_rank(ctx: Any, target: Callable[..., None], args: tuple[Any, ...], name: str) -> Any:
    """Start one rank process named ``name`` (daemonic: it never outlives the parent's clean
    exit)."""
    proc = ctx.Process(
        target=start_in_environment,
        args=(dict(os.environ), name, target, *args),
        name=name,
        daemon=True,
    )
    proc.start()
    return proc


def run_ranks(
    target: Callable[..., None], args: list[tuple[Any, ...]], name: str, timeout_s: float
) -> list[int | None]:
    """Run ``target(*args[r])`` in one rank process per entry and wait (bounded) for all of
    them; any still alive after ``timeout_s`` is killed. Returns the exit codes in rank order."""
    ctx = rank_context()
    procs = [start_rank(ctx, target, a, f"{name}-{r}") for r, a in enumerate(args)]
    try:
        for p in procs:
            p.join(timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    return [p.exitcode for p in procs]


def spawn_followers(
    config: EngineConfig,
    policy: Policy,
    group: GroupConfig,
    ranks: Sequence[int],
    port: int,
    orphan_guard: bool,
    leader_here: bool = False,
) -> list[Any]:
    """Start ``ranks`` as followers; ``leader_here``: the caller is their leader (it stops them,
    and a Ctrl-C in the terminal is its to handle, not theirs)."""
    ctx = rank_context()
    cores = usable_cores()  # before the leader pins itself: every rank splits the same set
    return [
        start_rank(
            ctx,
            follower_main,
            (config, policy, group, rank, port, orphan_guard, cores, leader_here),
            f"gs-rank-{rank}",
        )
        for rank in ranks
    ]


def stop_processes(procs: list[Any], timeout: float = 30.0) -> None:
    """Wait for ranks to finish, then kill what is left; nothing outlives the group."""
    for proc in procs:
        proc.join(timeout)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
