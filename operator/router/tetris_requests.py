"""The router's Tetris planning for one group (Tetris §5.1–5.2): a chunk plan and a decode
instance for each request, from the router's global view of the group's instances.

The view is the group's last ``WorkerStats.instances`` (prefill queue times T_k, decode KV slots
and batch sizes). Between two polls the router keeps it current itself: the queues advance by the
time passed (Eq. (2)), every plan it makes books its chunks onto the prefill instances and its KV
onto the decode instance as virtual usage (§5.2), so a burst of requests between polls is spread
as the paper's planner spreads it. Parameters (latency models, candidates, improvement rate and
its table, decode placement) come from the group's active ``TetrisPolicy``: a live change applies
at the next request. A policy without latency models takes the ones the group fitted itself at
start (``WorkerStats.tetris_models``, source AUTO_FITTED). A policy with neither an improvement
rate nor a table gets a table the router profiles from the models and the prompts it has seen
(``tetris_rate_profile.py``, §5.1); each plan says which rate it used and where it came from.

A request no decode instance has room for now raises ``TetrisNoRoom`` before anything is booked
or counted (its arrival, its prompt for the profiler): the router queues it and plans it again
when a poll reports room (``room_queue.py``). One that needs more KV slots than any decode
instance holds when empty (``InstanceStats.kv_slots_total``) raises ``TetrisNeverFits``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gearshift.operator.planner.cdsp import ChunkPlan, plan_request
from gearshift.operator.planner.decode_placement import DecodeLoad, DecodePlacer
from gearshift.operator.planner.improvement_rate import ImprovementRate
from gearshift.operator.planner.instance_pool import Pool
from gearshift.operator.planner.settings import PlannerSettings
from gearshift.operator.router.policy_control import NeverFits, NoRoomYet
from gearshift.operator.router.tetris_rate_profile import RateProfiler
from gearshift.v1 import policy_pb2, worker_pb2

PREFILL = worker_pb2.InstanceStats.PREFILL
DECODE = worker_pb2.InstanceStats.DECODE
POLICY_CONSTANT = worker_pb2.TetrisPlan.POLICY_CONSTANT
POLICY_TABLE = worker_pb2.TetrisPlan.POLICY_TABLE
PROFILED = worker_pb2.TetrisPlan.PROFILED
DEFAULT = worker_pb2.TetrisPlan.DEFAULT


def _models_of(
    stats: worker_pb2.WorkerStats,
) -> Sequence[policy_pb2.TetrisPolicy.LatencyModel]:
    """The group's Eq. (1) models: its policy's, else those it fitted at start, else none."""
    if stats.policy.tetris.latency_models:
        return stats.policy.tetris.latency_models
    if stats.tetris_models.source == worker_pb2.TetrisModelStatus.AUTO_FITTED:
        return stats.tetris_models.models
    return ()


class TetrisPlanningError(ValueError):
    """The group's policy or instances cannot be planned for (the message names why)."""


class TetrisNoRoom(TetrisPlanningError, NoRoomYet):
    """No decode instance has the request's KV slots available now: it waits for room."""


class TetrisNeverFits(TetrisPlanningError, NeverFits):
    """The request needs more KV slots than any decode instance holds when empty."""


@dataclass
class TetrisRequestPlanner:
    """Plans the requests the router sends to one tetris group."""

    clock: Callable[[], float] = time.monotonic
    _policy: bytes = b""
    _settings: PlannerSettings | None = None
    _rate: ImprovementRate | None = None
    _placer: DecodePlacer | None = None
    _stats: worker_pb2.WorkerStats | None = None
    _pool: Pool | None = None
    _pool_at: float = 0.0
    _decode: list[DecodeLoad] = field(default_factory=list)
    _decode_index: list[int] = field(default_factory=list)
    _decode_total: list[int] = field(default_factory=list)  # KV slots when empty; 0: unknown
    _profiler: RateProfiler = field(default_factory=RateProfiler)
    _nodes: tuple[int, ...] = ()  # each prefill instance's node, by index

    def plan_into(
        self, stats: worker_pb2.WorkerStats, wire: worker_pb2.WorkerGenerateRequest, max_tokens: int
    ) -> None:
        """Set the request's ``tetris_plan`` (raises TetrisPlanningError). A group with no
        Eq. (1) models, neither in its policy nor fitted at start, gets no plan: it runs the
        prompt as one chunk over its whole pool and places decode itself
        (WorkerGenerateRequest.tetris_plan)."""
        if stats.policy.WhichOneof("kind") == "tetris" and not _models_of(stats):
            return
        wire.tetris_plan.CopyFrom(self.plan(stats, len(wire.prompt_token_ids), max_tokens))

    def plan(
        self, stats: worker_pb2.WorkerStats, prompt_tokens: int, max_tokens: int
    ) -> worker_pb2.TetrisPlan:
        """The request's chunk plan and decode instance (raises TetrisPlanningError)."""
        now = self.clock()
        self._configure(stats)
        assert self._settings is not None and self._rate is not None and self._placer is not None
        self._view(stats, now)
        assert self._pool is not None
        # Decode room first: a request that must wait books and counts nothing yet.
        slots = prompt_tokens + max_tokens
        decode = self._placer.choose(self._decode, slots)
        if decode is None:
            raise self._no_room(slots)
        self._rate.record_arrival(now)
        if self._settings.profile_rates and prompt_tokens > 0:
            table = self._profiler.observe(prompt_tokens, self._settings.rules, self._nodes)
            if table is not None:
                self._rate.set_table(table)
        improvement = self._rate.current(now)
        pool = self._pool.advance(now - self._pool_at)
        try:
            chunks = plan_request(prompt_tokens, pool, self._settings.rules, improvement)
        except ValueError as exc:
            raise TetrisPlanningError(f"tetris plan: {exc}") from exc
        self._book(pool, now, chunks, decode, slots)
        out = worker_pb2.TetrisPlan(
            decode_instance=self._decode_index[decode],
            planned_prefill_seconds=chunks.ttft,
            improvement_rate=improvement,
            improvement_rate_source=self._rate_source(),
        )
        for chunk in chunks.chunks:
            out.chunks.add(num_tokens=chunk.length, prefill_instances=list(chunk.group))
        return out

    def _no_room(self, slots: int) -> TetrisPlanningError:
        """Why no decode instance takes ``slots`` now: never (every instance reports what it
        holds when empty, and none holds that many), or not yet."""
        if self._decode_total and all(self._decode_total):
            most = max(self._decode_total)
            if slots > most:
                return TetrisNeverFits(
                    f"this request needs {slots} KV slots (prompt + max_tokens) and no decode "
                    f"instance holds more than {most} even when empty; shorten the prompt or "
                    "lower max_tokens"
                )
        return TetrisNoRoom(f"no decode instance has {slots} free KV slots for this request")

    def _configure(self, stats: worker_pb2.WorkerStats) -> None:
        if stats.policy.WhichOneof("kind") != "tetris":
            raise TetrisPlanningError("the group does not run the tetris policy")
        tetris = stats.policy.tetris
        if not tetris.latency_models and _models_of(stats):
            tetris = policy_pb2.TetrisPolicy()
            tetris.CopyFrom(stats.policy.tetris)
            tetris.latency_models.extend(_models_of(stats))
        raw = tetris.SerializeToString(deterministic=True)
        if raw == self._policy and self._settings is not None:
            return
        try:
            settings = PlannerSettings.from_proto(tetris)
        except ValueError as exc:
            raise TetrisPlanningError(str(exc)) from exc
        self._policy, self._settings = raw, settings
        # A changed policy starts its rate window afresh (live parameters are rare), and a
        # profiled table is profiled again, from the new models, at the next request.
        self._rate = ImprovementRate(
            settings.rate_table, settings.improvement_rate, settings.rate_window_seconds
        )
        self._profiler.renew()
        if self._placer is None or self._placer.strategy is not settings.placement:
            self._placer = DecodePlacer(settings.placement)

    def _rate_source(self) -> worker_pb2.TetrisPlan.RateSource:
        assert self._settings is not None and self._rate is not None
        if self._settings.profile_rates:
            return PROFILED if self._rate.table else DEFAULT
        return POLICY_TABLE if self._settings.rate_table else POLICY_CONSTANT

    def _view(self, stats: worker_pb2.WorkerStats, now: float) -> None:
        """A new poll replaces the view; otherwise the router's own bookings stand."""
        if stats is self._stats and self._pool is not None:
            return
        prefill = sorted((i for i in stats.instances if i.role == PREFILL), key=lambda i: i.index)
        decode = sorted((i for i in stats.instances if i.role == DECODE), key=lambda i: i.index)
        if not prefill or not decode:
            raise TetrisPlanningError(
                f"the group reports {len(prefill)} prefill and {len(decode)} decode instances"
            )
        ids = [i.index for i in prefill]
        if ids != list(range(len(ids))):
            raise TetrisPlanningError(f"prefill instance indices {ids} are not 0..n-1")
        nodes = tuple(i.node for i in prefill)
        if nodes != self._nodes:
            self._profiler.renew()  # the pool changed (an instance down or back): profile again
        self._nodes = nodes
        self._pool = Pool({i.index: max(0.0, i.queued_seconds) for i in prefill}, self._nodes)
        self._pool_at = now
        self._decode = [
            DecodeLoad(i.kv_slots_free, i.batch_size, i.kv_slots_reserved) for i in decode
        ]
        self._decode_index = [i.index for i in decode]
        self._decode_total = [i.kv_slots_total for i in decode]
        self._stats = stats

    def _book(self, pool: Pool, now: float, plan: ChunkPlan, decode: int, slots: int) -> None:
        """Eq. (2) for the plan's chunks; the KV it sends counts as the decode instance's
        virtual usage until the next poll reports it."""
        self._pool = pool.commit((c.group, c.end) for c in plan.chunks)
        self._pool_at = now
        load = self._decode[decode]
        self._decode[decode] = DecodeLoad(
            load.free_slots, load.active + 1, load.in_flight_slots + slots
        )
