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

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from gearshift.worker.config import EngineConfig
from gearshift.worker.errors import GroupFailure, InvalidRequestError
from gearshift.worker.launch import replica_messages as msg
from gearshift.worker.launch.group_config import GroupConfig
from gearshift.worker.launch.host import usable_cores
from gearshift.worker.launch.processes import rank_context, start_rank, stop_processes
from gearshift.worker.launch.rank import check_comm_rules
from gearshift.worker.launch.replica_rank import replica_main
from gearshift.worker.parallel.watchdog import EXIT_PEER_FAILED
from gearshift.worker.policies.base import Policy
from gearshift.worker.sampling.params import SamplingParams

log = logging.getLogger(__name__)
A = TypeVar("A", bound=msg.Event)
# How long a failure report waits for the rank that ranks which exited as followers followed
# (their watchdog's EXIT_PEER_FAILED, or 1 after a failed collective) to be reported gone.
FOLLOWED_WAIT_S = 5.0
Pending = dict[int, set[str]]  # request ids not yet finished, per replica
Results = dict[str, tuple[list[int], str]]  # request id -> (tokens, finish reason or error)
Ended = msg.Finished | msg.Refused


@dataclass
class ReplicaGroup:
    """The calling process's handle on a running replica group."""

    policy: Policy
    procs: list[Any]  # every rank's process, in rank order
    conns: list[Connection]  # one per replica, to its leading rank
    store: Any
    timeout_s: float
    # Each replica's ReplicaReady as a dict ({"num_blocks", "max_model_len"}).
    ready: list[dict[str, Any]] = field(default_factory=list)
    _closed: bool = False
    _stopping: bool = False  # StopReplica sent: a rank that then exits 0 has simply finished
    # Requests that ended while waiting for another answer, per replica.
    _early: dict[int, list[Ended]] = field(default_factory=dict)

    @property
    def replicas(self) -> int:
        return len(self.conns)

    def raise_if_failed(self) -> None:
        """GroupFailure naming the replica that most likely failed first, if any rank has
        exited. Its peers follow it within moments (their watchdog exits with
        ``EXIT_PEER_FAILED``, or a collective with it fails and they exit with 1), so a rank
        killed by a signal is named before one that exited with a code, and those codes last."""
        if self._closed:
            return
        n = len(self.procs) // max(1, self.replicas)

        def ended() -> list[tuple[int, Any]]:
            return [
                (r, p.exitcode)
                for r, p in enumerate(self.procs)
                if not p.is_alive() and not (self._stopping and p.exitcode == 0)
            ]

        def followed(code: Any) -> bool:
            return code in (1, EXIT_PEER_FAILED)

        dead = ended()
        if not dead:
            return
        # Only followers have ended: the peer they followed is gone or hung, and the fork
        # server may not have reported its exit yet. Wait for it a little, so it is named.
        deadline = time.monotonic() + FOLLOWED_WAIT_S
        while all(followed(c) for _, c in dead) and time.monotonic() < deadline:
            if len(dead) == len(self.procs):
                break
            time.sleep(0.05)
            dead = ended()

        def likely_first(item: tuple[int, Any]) -> tuple[int, int]:
            rank, code = item
            return (0 if code is not None and code < 0 else 2 if followed(code) else 1, rank)

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
                self.raise_if_failed()
            except GroupFailure as failure:
                return failure
            time.sleep(0.05)
        return GroupFailure(f"replica group: replica {r}'s connection failed: {exc}")

    def send(self, r: int, command: msg.Command) -> None:
        """Send a command to replica ``r``; GroupFailure naming who failed if it is gone."""
        try:
            msg.TO_REPLICA.send(self.conns[r], command)
        except OSError as exc:
            raise self._lost(r, exc) from exc

    def _recv(self, r: int, kind: type[A]) -> A:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            try:
                got = msg.FROM_REPLICA.recv(self.conns[r]) if self.conns[r].poll(0.05) else None
            except (EOFError, OSError) as exc:
                raise self._lost(r, exc) from exc
            match got:
                case None | msg.Output():
                    pass  # (Output: a stream's, after its reader stopped at shutdown)
                case msg.Finished() | msg.Refused():
                    self._early.setdefault(r, []).append(got)
                case _ if isinstance(got, kind):
                    return got
                case _:
                    name = type(got).__name__
                    raise RuntimeError(f"replica {r}: expected {kind.__name__}, got {name}")
            self.raise_if_failed()
        raise GroupFailure(f"replica {r} did not answer {kind.__name__} in {self.timeout_s} s")

    def submit(self, work: dict[int, list[tuple[str, list[int], SamplingParams]]]) -> Pending:
        """Queue each replica's requests; ``poll`` collects them as they finish."""
        pending: Pending = {}
        for r, reqs in work.items():
            for rid, ids, params in reqs:
                self.send(r, msg.AddRequest(rid, ids, params))
            pending[r] = {rid for rid, _, _ in reqs}
        return pending

    def poll(self, pending: Pending, results: Results, wait_s: float = 0.01) -> None:
        """Move finished requests from ``pending`` into ``results`` (request id -> (tokens,
        finish reason or error)); raises GroupFailure if a replica died."""
        for r, left in pending.items():
            early = self._early.pop(r, [])
            try:
                while left and (early or self.conns[r].poll(wait_s)):
                    ended = early.pop(0) if early else msg.FROM_REPLICA.recv(self.conns[r])
                    match ended:
                        case msg.Finished():
                            results[ended.request_id] = (ended.token_ids, ended.reason)
                        case msg.Refused():
                            results[ended.request_id] = ([], f"error: {ended.error}")
                        case _:
                            raise RuntimeError(f"replica {r}: unexpected {type(ended).__name__}")
                    left.discard(ended.request_id)
            except (EOFError, OSError) as exc:
                raise self._lost(r, exc) from exc
            if early:
                self._early[r] = early
        self.raise_if_failed()

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
        """Replica ``r``'s figures: ``{"policy", "sync", "engine"}``."""
        self.send(r, msg.GetStats())
        got = self._recv(r, msg.ReplicaStats)
        return {"policy": got.policy, "sync": json.loads(got.sync_json), "engine": got.engine}

    def shutdown(self) -> list[dict[str, Any]]:
        """Stop every replica together; what each reported about its KV blocks."""
        if self._closed:
            return []
        reports = []
        self._stopping = True
        try:
            for conn in self.conns:
                msg.TO_REPLICA.send(conn, msg.StopReplica())
            reports = [asdict(self._recv(r, msg.Closed)) for r in range(self.replicas)]
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
    procs: list[Any] = []
    conns: list[Connection] = []
    for rank in range(world):
        parent, child = ctx.Pipe() if rank % n == 0 else (None, None)
        proc = start_rank(
            ctx,
            replica_main,
            (config, policy, group, rank, port, child, cores, stream),
            f"gs-replica-{rank // n}" + (f"r{rank}" if n > 1 else ""),
        )
        procs.append(proc)
        if parent is not None and child is not None:
            child.close()
            conns.append(parent)
    handle = ReplicaGroup(policy, procs, conns, store, group.timeout_s)
    try:
        handle.ready = [asdict(handle._recv(r, msg.ReplicaReady)) for r in range(replicas)]
    except BaseException:
        handle.kill()
        raise
    return handle
