"""A worker endpoint that serves a replica group (``Policy.engine_replicas() > 1``).

The group's replicas are processes of this host (launch/replicas.py), each with its own engine;
this handle is the one EngineHandle the gRPC service sees. A request goes to the replica with the
fewest requests in flight (the router routes to the endpoint; the endpoint to a replica), each
step's outputs come back over the replica's pipe. The group is one failure domain: a replica that
dies ends the endpoint (every request fails, GetStatus reports the named replica), and the
router stops routing to it as for any dead group. Stats are the replicas' engine stats summed,
with the policy's own figures merged by ``Policy.group_stats`` (per replica and group-wide).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import fields, replace
from multiprocessing.connection import wait
from typing import Any

from google.protobuf.message import Message

from gearshift.v1 import policy_pb2, worker_pb2
from gearshift.worker.engine.contract import LiveValue
from gearshift.worker.engine.llm_engine import EngineStats, ReplicaLoad
from gearshift.worker.errors import GroupFailure, InvalidRequestError
from gearshift.worker.launch import replica_messages as msg
from gearshift.worker.launch.replicas import ReplicaGroup, start_replicas
from gearshift.worker.policies.registry import make_policy
from gearshift.worker.server.engine_loop import EngineStopped, OutputSink
from gearshift.worker.server.engine_process import STATS_INTERVAL_S, EngineStartError
from gearshift.worker.server.factory import engine_config, group_config
from gearshift.worker.server.settings import WorkerSettings
from gearshift.worker.wire import WireError

log = logging.getLogger(__name__)

_EMPTY = EngineStats(0, 0, 0, 0, 0.0, 0, 0, 0, 0, 0, 0)


def merge_stats(parts: list[EngineStats], policy_stats: dict[str, float]) -> EngineStats:
    """The group's stats: counts summed over replicas, KV usage over all their blocks."""
    if not parts:
        return _EMPTY
    summed: dict[str, Any] = {}
    for f in fields(EngineStats):
        values = [getattr(p, f.name) for p in parts]
        if isinstance(values[0], int):
            summed[f.name] = sum(values)
    total = summed["kv_blocks_total"]
    gear_steps: dict[str, int] = {}
    gear_tokens: dict[str, int] = {}
    for p in parts:
        for k, v in p.gear_steps.items():
            gear_steps[k] = gear_steps.get(k, 0) + v
        for k, v in p.gear_tokens.items():
            gear_tokens[k] = gear_tokens.get(k, 0) + v
    return replace(
        parts[0],
        **summed,
        kv_usage=summed["kv_blocks_used"] / total if total else 0.0,
        gear_steps=gear_steps,
        gear_tokens=gear_tokens,
        policy_stats=policy_stats,
    )


def _why(group: ReplicaGroup, exc: BaseException) -> str:
    """The failure naming the replica: a killed one closes its pipe before it can be reaped, so
    wait (bounded) for its exit code."""
    if isinstance(exc, GroupFailure):
        return str(exc)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            group.raise_if_failed()
        except GroupFailure as failure:
            return str(failure)
        time.sleep(0.05)
    return f"replica group: a replica's pipe failed ({type(exc).__name__}: {exc})"


class ReplicaGroupEngine:
    """An EngineHandle over a replica group hosted by this process."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self._policy = make_policy(settings.policy, settings.ranks)
        self.policy = self._policy.to_proto()
        self.max_model_len = 0
        self.replicas = self._policy.engine_replicas()
        self.plan_field: str | None = None
        self._group: ReplicaGroup | None = None
        self._sinks: dict[str, tuple[int, OutputSink]] = {}
        self._load: list[int] = []  # requests in flight, per replica
        self._stats: list[EngineStats] = []
        self._dead: str | None = None
        self._closed = False
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self._reader: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        config = engine_config(self.settings)
        group = group_config(self._policy, heartbeat_timeout_s=self.settings.heartbeat_timeout_s)
        try:
            self._group = await asyncio.to_thread(start_replicas, config, self._policy, group, True)
        except Exception as exc:
            raise EngineStartError(f"{type(exc).__name__}: {exc}") from exc
        n = self._group.replicas
        self.max_model_len = int(self._group.ready[0]["max_model_len"])
        self._load = [0] * n
        self._stats = [_EMPTY] * n
        self._reader = threading.Thread(target=self._read, name="replica-reader", daemon=True)
        self._reader.start()

    # ---- the reader thread: outputs, stats and the group's health ---------------------------

    def _send(self, r: int, command: msg.Command) -> None:
        assert self._group is not None
        data = msg.TO_REPLICA.encode(command)
        with self._send_lock:
            self._group.conns[r].send_bytes(data)

    def _read(self) -> None:
        group = self._group
        assert group is not None and self._loop is not None
        next_stats = 0.0
        while not self._stop.is_set():
            now = self._loop.time()
            try:
                if now >= next_stats:
                    next_stats = now + STATS_INTERVAL_S
                    for r in range(group.replicas):
                        self._send(r, msg.GetSnapshot())
                ready = wait(group.conns, timeout=STATS_INTERVAL_S / 2)
                batch: list[tuple[int, msg.Event]] = []
                for r, conn in enumerate(group.conns):
                    while conn in ready and conn.poll():
                        batch.append((r, msg.FROM_REPLICA.recv(conn)))
                group.raise_if_failed()
            except (EOFError, OSError, GroupFailure, WireError) as exc:
                if self._stop.is_set():
                    return
                self._loop.call_soon_threadsafe(self._fail, _why(group, exc))
                return
            if batch:
                self._loop.call_soon_threadsafe(self._handle, batch)

    def _handle(self, batch: list[tuple[int, msg.Event]]) -> None:
        for r, message in batch:
            match message:
                case msg.Output():
                    out = message.output
                    entry = self._sinks.get(out.request_id)
                    if entry is None:
                        continue
                    if out.finished:
                        del self._sinks[out.request_id]
                        self._load[r] -= 1
                    entry[1](out)
                case msg.Refused():  # at admission (InvalidRequestError)
                    entry = self._sinks.pop(message.request_id, None)
                    if entry is not None:
                        self._load[r] -= 1
                        entry[1](InvalidRequestError("request", message.error))
                case msg.Snapshot():
                    self._stats[r] = message.engine

    def _fail(self, reason: str) -> None:
        if self._closed:
            return
        log.error("%s", reason)
        self._dead = reason
        self._closed = True
        for _, sink in self._sinks.values():
            sink(EngineStopped(reason))
        self._sinks.clear()
        if self._group is not None:
            self._group.kill()  # the rest of the group: one failure domain

    # ---- EngineHandle ----------------------------------------------------------------------

    @property
    def stats_extra(self) -> worker_pb2.WorkerStats | None:
        return None

    @property
    def snapshot(self) -> EngineStats:
        per = [s.policy_stats for s in self._stats]
        merged = self._policy.group_stats(per)
        for r, s in enumerate(self._stats):
            merged[f"replica{r}_batch"] = float(s.num_running)
            merged[f"replica{r}_steps"] = float(s.steps)
            # With the steps: the router's mode controller derives the mean batch per step.
            merged[f"replica{r}_generation_tokens"] = float(s.generation_tokens)
        return replace(
            merge_stats(self._stats, merged),
            replicas=[
                ReplicaLoad(s.num_running, s.num_waiting, s.outstanding_tokens) for s in self._stats
            ],
        )

    @property
    def dead(self) -> str | None:
        return self._dead

    @property
    def alive(self) -> bool:
        return not self._closed

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: Any,
        sink: OutputSink,
        arrival_time: float,
        replica: int | None = None,
        plan: Message | None = None,
    ) -> None:
        del arrival_time, plan  # each replica's engine stamps its own arrival; takes no plan
        if self._closed or self._group is None:
            sink(EngineStopped(self._dead or "the replica group is shutting down"))
            return
        # The router names the replica (it routes to each); otherwise the least busy one.
        r = (
            replica
            if replica is not None
            else min(range(self.replicas), key=self._load.__getitem__)
        )
        self._sinks[request_id] = (r, sink)
        self._load[r] += 1
        self._send(r, msg.AddRequest(request_id, prompt_token_ids, params))

    async def abort(self, request_id: str) -> bool:
        entry = self._sinks.pop(request_id, None)
        if entry is None or self._closed:
            return False
        self._load[entry[0]] -= 1
        self._send(entry[0], msg.AbortRequest(request_id))
        return True

    async def apply_live(self, values: dict[str, LiveValue]) -> policy_pb2.Policy:
        if self._closed or self._group is None:
            raise EngineStopped(self._dead or "the replica group is shutting down")
        probe = make_policy(self._policy.to_proto(), self.settings.ranks)
        probe.update_live(values)  # refuses a bad value, naming the field, changing nothing
        self._policy.apply_group_live(self._group.store, values)  # may refuse what it cannot
        self._policy.update_live(values)
        self.policy = self._policy.to_proto()
        return self.policy

    async def apply_decision(self, values: dict[str, LiveValue]) -> None:
        """A router controller's decision (e.g. the group's mode): checked like a live change,
        handed to the group, and not kept in the configured policy."""
        if self._closed or self._group is None:
            raise EngineStopped(self._dead or "the replica group is shutting down")
        probe = make_policy(self._policy.to_proto(), self.settings.ranks)
        probe.update_live(values)  # refuses a bad value, naming the field
        self._policy.apply_group_live(self._group.store, values)

    async def stop(self, timeout_s: float = 15.0) -> None:
        del timeout_s  # the group's own timeout bounds its shutdown
        self._stop.set()
        if self._reader is not None:
            await asyncio.to_thread(self._reader.join, 5)
        group, self._group = self._group, None
        was_closed, self._closed = self._closed, True
        sinks, self._sinks = self._sinks, {}
        for _, sink in sinks.values():
            sink(EngineStopped("the engine stopped"))
        if group is None or was_closed:
            return
        # A stopping replica finishes what it runs: abort it all first, then stop together.
        with contextlib.suppress(OSError):
            for rid, (r, _) in sinks.items():
                msg.TO_REPLICA.send(group.conns[r], msg.AbortRequest(rid))
        try:
            await asyncio.to_thread(group.shutdown)
        except (OSError, GroupFailure, RuntimeError) as exc:
            log.warning("replica group stopped uncleanly: %s", exc)
        group.kill()
