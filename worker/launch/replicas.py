"""A worker group of several engine replicas (``Policy.engine_replicas() > 1``), on one host.

Every replica has its own engine (scheduler, block manager, KV cache, sampler) in the process of
its leading rank; a replica of several ranks (tensor parallel inside, ranks ``r * n .. r * n +
n - 1`` for ``n`` ranks per replica) drives its other ranks as a plain group's leader does, over
a control channel of its own. Together they form one torch.distributed group, whose rendezvous
store this (the calling) process hosts. A replica meets its peers only through the policy's
``ReplicaSync`` at step boundaries. The caller drives replicas over pipes: queue requests on a
replica, collect the finished ones, read stats, stop the group. A replica that dies ends the
group (its peers' watchdogs stop them) and the next call here raises ``GroupFailure`` naming it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from gearshift.worker.config import EngineConfig
from gearshift.worker.errors import GroupFailure, InvalidRequestError
from gearshift.worker.launch.group_config import GroupConfig
from gearshift.worker.launch.host import usable_cores
from gearshift.worker.launch.processes import rank_context, start_rank, stop_processes
from gearshift.worker.launch.rank import check_comm_rules
from gearshift.worker.launch.replica_rank import replica_main
from gearshift.worker.parallel.watchdog import EXIT_PEER_FAILED
from gearshift.worker.policies.base import Policy
from gearshift.worker.sampling.params import SamplingParams

log = logging.getLogger(__name__)
Pending = dict[int, set[str]]  # request ids not yet finished, per replica
Results = dict[str, tuple[list[int], str]]  # request id -> (tokens, finish reason or error)


@dataclass
class ReplicaGroup:
    """The calling process's handle on a running replica group."""

    policy: Policy
    procs: list[Any]  # every rank's process, in rank order
    conns: list[Any]  # one per replica, to its leading rank
    store: Any
    timeout_s: float
    ready: list[dict[str, Any]] = field(default_factory=list)
    _closed: bool = False
    # "finished" messages that arrived while waiting for another answer, per replica.
    _early: dict[int, list[Any]] = field(default_factory=dict)

    @property
    def replicas(self) -> int:
        return len(self.conns)

    def _check(self) -> None:
        """GroupFailure naming the replica that most likely failed first, if any rank has
        exited. Its peers follow it within moments (their watchdog exits with
        ``EXIT_PEER_FAILED``, or a collective with it fails and they exit with 1), so a rank
        killed by a signal is named before one that exited with a code, and those codes last."""
        if self._closed:
            return
        n = len(self.procs) // max(1, self.replicas)
        dead = [(r, p.exitcode) for r, p in enumerate(self.procs) if not p.is_alive()]
        if not dead:
            return

        def likely_first(item: tuple[int, Any]) -> tuple[int, int]:
            rank, code = item
            followed = code in (1, EXIT_PEER_FAILED)
            return (0 if code is not None and code < 0 else 2 if followed else 1, rank)

        rank, code = min(dead, key=likely_first)
        raise GroupFailure(
            f"replica group: replica {rank // n} (rank {rank}) exited with code {code}; the "
            "group's replicas fail together"
        )

    def _lost(self, r: int, exc: BaseException) -> GroupFailure:
        """A replica's pipe broke: its process is gone (or going); name who failed."""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                self._check()
            except GroupFailure as failure:
                return failure
            time.sleep(0.05)
        return GroupFailure(f"replica group: replica {r}'s connection failed: {exc}")

    def _recv(self, r: int, kind: str) -> Any:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            try:
                msg = self.conns[r].recv() if self.conns[r].poll(0.05) else None
            except (EOFError, OSError) as exc:
                raise self._lost(r, exc) from exc
            if msg is not None:
                if msg[0] == kind:
                    return msg
                if msg[0] == "out":
                    continue  # a stream's output after its reader stopped (shutdown)
                if msg[0] != "finished":
                    raise RuntimeError(f"replica {r}: expected {kind}, got {msg[0]}")
                self._early.setdefault(r, []).append(msg)
            self._check()
        raise GroupFailure(f"replica {r} did not answer {kind!r} in {self.timeout_s} s")

    def submit(self, work: dict[int, list[tuple[str, list[int], SamplingParams]]]) -> Pending:
        """Queue each replica's requests; ``poll`` collects them as they finish."""
        pending: Pending = {}
        for r, reqs in work.items():
            for rid, ids, params in reqs:
                try:
                    self.conns[r].send(("add", rid, ids, params))
                except OSError as exc:
                    raise self._lost(r, exc) from exc
            pending[r] = {rid for rid, _, _ in reqs}
        return pending

    def poll(self, pending: Pending, results: Results, wait_s: float = 0.01) -> None:
        """Move finished requests from ``pending`` into ``results`` (request id -> (tokens,
        finish reason or error)); raises GroupFailure if a replica died."""
        for r, left in pending.items():
            early = self._early.pop(r, [])
            try:
                while left and (early or self.conns[r].poll(wait_s)):
                    _, rid, tokens, reason = early.pop(0) if early else self.conns[r].recv()
                    results[rid] = (tokens, reason)
                    left.discard(rid)
            except (EOFError, OSError) as exc:
                raise self._lost(r, exc) from exc
            if early:
                self._early[r] = early
        self._check()

    def generate(self, work: dict[int, list[tuple[str, list[int], SamplingParams]]]) -> Results:
        """Queue each replica's requests at once; wait for all: request id -> (tokens, reason)."""
        pending = self.submit(work)
        results: Results = {}
        deadline = time.monotonic() + self.timeout_s
        while any(pending.values()):
            if time.monotonic() > deadline:
                raise GroupFailure(f"replica requests unfinished after {self.timeout_s} s")
            self.poll(pending, results)
        return results

    def stats(self, r: int) -> dict[str, Any]:
        self.conns[r].send(("stats",))
        return self._recv(r, "stats")[1]

    def shutdown(self) -> list[dict[str, Any]]:
        """Stop every replica together; what each reported about its KV blocks."""
        if self._closed:
            return []
        reports = []
        try:
            for conn in self.conns:
                conn.send(("stop",))
            reports = [self._recv(r, "closed")[1] for r in range(self.replicas)]
        except (OSError, GroupFailure):
            self.kill()  # a replica is gone: nothing to stop in order
            raise
        finally:
            self._closed = True
            stop_processes(self.procs, timeout=10)
            self.policy.release_group()
            for conn in self.conns:
                conn.close()
            self.store = None
        return reports

    def kill(self) -> None:
        """Tear the group down without asking (after a failure)."""
        self._closed = True
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        stop_processes(self.procs, timeout=10)
        self.policy.release_group()
        self.store = None


def start_replicas(
    config: EngineConfig, policy: Policy, group: GroupConfig | None = None, stream: bool = False
) -> ReplicaGroup:
    """Spawn the group's replicas on this host and wait until each has loaded; ``stream``: they
    send every step's outputs (a server's replicas, see worker/server/replica_engine.py)."""
    check_comm_rules()
    group = group or GroupConfig()
    world = policy.world_size
    replicas = policy.engine_replicas()
    if world % replicas:
        raise InvalidRequestError(
            "policy", f"{world} ranks do not form {replicas} replicas of equal size"
        )
    n = world // replicas
    store = group.host_store(world)
    port = int(store.port)
    ctx = rank_context()
    cores = usable_cores()
    procs, conns = [], []
    for rank in range(world):
        parent, child = ctx.Pipe() if rank % n == 0 else (None, None)
        proc = start_rank(
            ctx,
            replica_main,
            (config, policy, group, rank, port, child, cores, stream),
            f"gs-replica-{rank // n}" + (f"r{rank}" if n > 1 else ""),
        )
        procs.append(proc)
        if child is not None:
            child.close()
            conns.append(parent)
    handle = ReplicaGroup(policy, procs, conns, store, group.timeout_s)
    try:
        handle.ready = [handle._recv(r, "ready")[1] for r in range(replicas)]
    except BaseException:
        handle.kill()
        raise
    return handle
