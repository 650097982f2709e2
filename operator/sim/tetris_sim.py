"""A Tetris group in simulated time (issue 16, item 1; Tetris §3.2, §4–5): the router's planner
on the prefill pool, the KV hand-off, and decode instances that run the engine's own admission.

* **Prefill pool.** Each arrival is planned by the real planner (``operator/planner``:
  Algorithm 1 with the improvement rate the router's ``ImprovementRate`` picks from the policy's
  rate table by the arrivals of the last window, in simulated time, else the constant; over the
  pool's queues advanced by Eq. (2)), with Eq. (1)
  models fitted to the roofline (``tetris_models.py``); its prefill ends at the plan's TTFT (the
  planner's own estimate, queueing included), and the plan's chunks are booked on the pool.
* **Decode placement** by the planner's ``DecodePlacer`` (freeness rate with virtual usage,
  §5.2) over each decode instance's free slots, batch and requests in transfer. A request no
  decode instance has room for waits, as in the router (``operator/router/room_queue.py``): in
  arrival order, placed (and only then planned on the pool and counted as an arrival by the
  improvement rate) when a decode step ends with room for the oldest waiting request; a later
  request never goes ahead of an older one. Its TTFT counts from its arrival, the wait
  included. A request that needs more KV slots than a decode instance holds when empty (or
  more than ``max_model_len``) is refused, and so is one still waiting past the router's
  ``--queue-timeout`` (``queue_timeout_s``, checked whenever a step ends). The router plans
  waiting requests at its stats polls (every 0.5 s), the simulator as soon as a step frees the
  room: that delay is not modelled.
* **Hand-off** (§4.2): the request's KV over the intra-node link from the last group's members in
  parallel, after its prefill ends, on one of the decode instance's transfer slots
  (``transferBackends``; by default one per prefill instance). As in the engine
  (``worker/policies/tetris/transfer.py``, ``launch/tetris/reader.py``) each member's rows go
  in pieces of at most the transfer buffer (``transferBufferBytes``, ``launch/tetris/state.py``
  ``pieces_of``); a piece holds its slot from its grant until the decode step that receives it
  has ended and reported it landed, and waiting pieces are granted in the order their prefills
  ended. So a burst of short prompts, or a long prompt of many pieces, lands at most ``slots``
  pieces a decode step, and the rest queue behind the decode instance's steps: a request's
  first token can wait several of them.
* **Decode instances** are simulated replicas (``replica.SimReplica``) whose leader is the
  engine's own ``DecodeAdmission`` (``worker/policies/tetris/admission.py``): the request's prompt
  blocks are reserved when it is placed, the landed KV is a receive step, the request then joins
  continuous batching with its last prompt token as its first decode row, as in the engine.

* **Ranks sharing a host's cores** (``host_cores``, the CPU build on one machine): the plans
  run as the engine runs them (each prefill instance takes its requests in arrival order, a chunk
  starts once its group's instances have reached it and the chunk before it is done), each chunk
  for its Eq. (1) seconds, and the decode steps alongside, all on ``shared_cores.SharedCores``:
  processor-shared over the cores, and with ``host_gangs`` each ring chunk advancing only while
  all its members hold a core. The planner still plans with Eq. (1) and its own queue view, as
  the router does. Without ``host_cores`` (a device per rank) a prefill ends at its plan's TTFT.
* **A pool pinned apart** (``pool_cores``, the CPU build with the pool's ranks pinned to
  ``pool_cores`` cores and each decode instance's ranks to cores of their own): the decode
  steps take what the cost model says; the pool's chunks share the pool's cores, processor-shared,
  each chunk over ``min(members, pool_cores)`` of them. Its Eq. (1) models are measured on those
  cores (``TetrisGroup.profile`` on the running group), so a ring whose members share one core
  is priced by its profile and not slowed again.
* **The hand-off is work on the cores** (``handoff_is_work``, with ``host_cores`` or
  ``pool_cores``): on the CPU build a piece's trip is the sending member's gloo send, the pipes'
  messages and the handshake, all computed by processes on the same cores, so each piece's
  hand-off time (measured on the idle group, where it runs at full speed) is one rank's work on
  the pool's cores, shared with the chunks and decode steps there. In a burst it slows the next
  prefills and is slowed by them. (``sim_fidelity_tetris.py`` also prices each run with the
  hand-off as a plain wait, ``handoff_wait``.)
* **The pool beside other ranks** (``pool_beside``, with ``host_cores`` or ``pool_cores``): a
  chunk computes that much slower while another rank computes beside it (a decode step, another
  chunk, a hand-off; ``shared_cores.SharedCores`` ``beside``), even on a core of its own: the
  ranks share the host's caches, memory bandwidth and clock. Eq. (1) is profiled one chunk at a
  time on an idle group, so this is what a busy group's chunks add; ``benchmarks/
  sim_fidelity_tetris.py`` measures it as SP 1 chunks beside 8 decoding requests and beside the
  other instance's chunk, over the same chunks alone (``benchmarks/README.md``).

Not modelled: history rebalancing (it overlaps compute, §4.1).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gearshift.operator.planner.cdsp import Chunk, PlannerRules, plan_request
from gearshift.operator.planner.decode_placement import DecodeLoad, DecodePlacer, Placement
from gearshift.operator.planner.improvement_rate import ImprovementRate, RateStep
from gearshift.operator.planner.instance_pool import Pool
from gearshift.operator.router.config import RouterConfig
from gearshift.operator.sim.cost_model import StepCost
from gearshift.operator.sim.events import EventLoop
from gearshift.operator.sim.replica import ReplicaConfig, RequestTimes, SimReplica
from gearshift.operator.sim.results import SimResult
from gearshift.operator.sim.shared_cores import SharedCores
from gearshift.operator.sim.trace import TraceRequest
from gearshift.worker.engine.contract import QueueView, StepRequest
from gearshift.worker.engine.scheduler import ScheduledBatch, Scheduler
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.kv.block_manager import BlockManager
from gearshift.worker.policies.tetris.admission import DecodeAdmission

RECEIVE_STEP_S = 1e-6  # a step that only lands KV (its copy is priced as the hand-off)
# TetrisPolicy.transfer_buffer_bytes's default (policy.proto): the most a piece carries.
DEFAULT_TRANSFER_BUFFER_BYTES = 64 << 20


class DecodeHooks:
    """A decode instance's leader in simulated time: the engine's ``DecodeAdmission`` under
    the engine's call order (``step_request``, schedule, ``plan_sections`` /
    ``step_submitted``)."""

    def __init__(self, cost: StepCost, receive_s: Callable[[int], float] | None = None) -> None:
        self.cost = cost
        # What receiving a piece of so many rows adds to the step that receives it (None:
        # nothing; the hand-off's price is all before the step).
        self.receive_s = receive_s
        self.admission: DecodeAdmission | None = None
        self.queued_rows: list[int] = []  # the pieces the next step receives, by rows
        # How many pieces the step now running receives: they land (and free their transfer
        # slots) when it ends, as the engine's leader reports ``Landed`` after its step.
        self.receiving = 0

    def bind(self, scheduler: Scheduler, blocks: BlockManager) -> None:
        self.admission = DecodeAdmission(scheduler, blocks)

    def step_request(self, queues: QueueView) -> StepRequest:
        del queues
        assert self.admission is not None
        return self.admission.step_request()

    def held(self) -> frozenset[str]:
        return frozenset()

    def step_time(self, batch: ScheduledBatch) -> tuple[float, int]:
        assert self.admission is not None
        receiving = bool(self.admission.plan_sections())
        rows, self.queued_rows = (self.queued_rows, []) if receiving else ([], self.queued_rows)
        receive = sum(map(self.receive_s, rows)) if self.receive_s is not None else 0.0
        if batch.is_empty:
            return (RECEIVE_STEP_S + receive if receiving else 0.0), 1
        return self.cost.step_time(batch) + receive, 1

    def barrier(self) -> bool:
        return False

    def step_submitted(self) -> None:
        assert self.admission is not None
        self.admission.step_submitted()
        landed, _ = self.admission.take_reports()
        self.receiving = len(landed)

    def micro_batches(self) -> int:
        return 1


@dataclass(frozen=True)
class TetrisGroupSim:
    """One Tetris group: ``prefill`` TP-1 instances planned with ``rules``, ``decode`` instances
    of ``config`` priced by ``decode_cost``; ``kv_bytes_per_token`` and ``link`` price the
    hand-off (bytes / bandwidth + latency)."""

    prefill: int
    decode: int
    rules: PlannerRules
    improvement_rate: float
    config: ReplicaConfig
    decode_cost: StepCost
    kv_bytes_per_token: float
    link_bandwidth: float
    link_latency: float
    per_node: int = 8
    placement: Placement = Placement.FREENESS
    prefill_tp: int = 1  # each prefill instance's TP ranks send their head shards in parallel
    rate_table: tuple[RateStep, ...] = ()  # improvementRateTable; empty: the constant rate
    rate_window_s: float = 30.0  # rateWindowSeconds
    decode_tp: int = 1  # ranks of each decode instance
    # CPU cores that every rank of the group shares (one host, no device per rank), priced by
    # processor sharing; None: each rank computes on a device of its own.
    host_cores: int | None = None
    # With host_cores: a chunk's ring members are scheduled one by one, so it advances only
    # while all of them hold a core (shared_cores.SharedCores ``gangs``).
    host_gangs: bool = False
    # CPU cores the prefill pool's ranks are pinned to, the decode instances' ranks pinned to
    # others (module docstring); None: not pinned apart. Not with host_cores.
    pool_cores: int | None = None
    # Each decode instance's transfer slots (transferBackends); None: one per prefill instance,
    # the policy's default.
    transfer_slots: int | None = None
    # What a piece's receive adds to the decode step that lands it, latency plus bytes over
    # bandwidth (None: free; the link's price is then the whole hand-off, before the step).
    receive_latency: float = 0.0
    receive_bandwidth: float | None = None
    transfer_buffer_bytes: int = DEFAULT_TRANSFER_BUFFER_BYTES  # transferBufferBytes
    # How much slower a pool chunk computes while another rank computes beside it (module
    # docstring); 1: not at all. Only with host_cores or pool_cores.
    pool_beside: float = 1.0
    # With host_cores or pool_cores: each piece's hand-off is a rank's work on the pool's cores
    # (module docstring); False: a wait that takes no core.
    handoff_is_work: bool = True
    # The router's --queue-timeout: a request still waiting for decode room after it is
    # refused (503), as the router refuses it (None: it waits for ever).
    queue_timeout_s: float | None = RouterConfig.queue_timeout_s

    def __post_init__(self) -> None:
        if self.host_cores is not None and self.host_cores < 1:
            raise ValueError(f"host_cores must be >= 1, got {self.host_cores}")
        if self.host_gangs and self.host_cores is None:
            raise ValueError("host_gangs needs host_cores")
        if self.pool_cores is not None and (self.pool_cores < 1 or self.host_cores is not None):
            raise ValueError(
                f"pool_cores must be >= 1 and not with host_cores, got {self.pool_cores} "
                f"(host_cores {self.host_cores})"
            )
        if self.receive_latency < 0 or (
            self.receive_bandwidth is not None and self.receive_bandwidth <= 0
        ):
            raise ValueError(
                f"a receive needs latency >= 0 and bandwidth > 0, got {self.receive_latency}, "
                f"{self.receive_bandwidth}"
            )
        if self.transfer_slots is not None and self.transfer_slots < 1:
            raise ValueError(f"transfer_slots must be >= 1, got {self.transfer_slots}")
        if self.pool_beside < 1.0 or (
            self.pool_beside != 1.0 and self.host_cores is None and self.pool_cores is None
        ):
            raise ValueError(
                f"pool_beside must be >= 1, and other than 1 only with host_cores or "
                f"pool_cores, got {self.pool_beside}"
            )
        if self.transfer_buffer_bytes < 1:
            raise ValueError(
                f"transfer_buffer_bytes must be >= 1, got {self.transfer_buffer_bytes}"
            )

    def pieces(self, tokens: int, senders: int) -> list[int]:
        """The rows of each piece a request's KV is handed over in: each of ``senders``
        members' share of the rows (even, as the last group's zigzag leaves them) cut at the
        transfer buffer, by a decode rank's bytes a row (``launch/tetris/state.pieces_of``)."""
        row = self.kv_bytes_per_token / self.decode_tp
        per = max(1, int(self.transfer_buffer_bytes // max(row, 1.0)))
        base, extra = divmod(tokens, senders)
        out: list[int] = []
        for m in range(senders):
            n = base + (1 if m < extra else 0)
            out += [min(per, n - start) for start in range(0, n, per)]
        return out

    @property
    def slots(self) -> int:
        """Each decode instance's transfer slots."""
        return self.transfer_slots if self.transfer_slots is not None else self.prefill

    def receive_s(self, rows: int) -> float:
        """What landing a piece of ``rows`` rows adds to a decode step."""
        if self.receive_bandwidth is None:
            return self.receive_latency
        return self.receive_latency + rows * self.kv_bytes_per_token / self.receive_bandwidth

    def handoff_s(self, tokens: int, senders: int) -> float:
        """``senders`` instances' rows over the link, each instance's TP ranks in parallel."""
        per_rank = tokens * self.kv_bytes_per_token / (senders * self.prefill_tp)
        return per_rank / self.link_bandwidth + self.link_latency


@dataclass(eq=False)
class _Slots:
    """One decode instance's transfer slots: how many are free, and the pieces waiting for one
    (in the order their prefills ended, as first handshakes) as their hand-offs."""

    free: int
    waiting: collections.deque[Callable[[], None]] = dataclasses.field(
        default_factory=collections.deque
    )


@dataclass(eq=False)
class _Prefill:
    """A request's chunk plan as the pool runs it (``host_cores`` or ``pool_cores``)."""

    chunks: tuple[Chunk, ...]
    tokens: int
    prefilled: Callable[[], None]  # its prefill has ended: its KV is offered to the decode instance
    done: int = 0  # chunks finished
    running: bool = False


def simulate_tetris(group: TetrisGroupSim, trace: Sequence[TraceRequest]) -> SimResult:
    """Every request of ``trace`` through one Tetris group; deterministic."""
    loop = EventLoop()
    decodes = [
        SimReplica(
            i,
            group.config,
            group.decode_cost,
            hooks=DecodeHooks(group.decode_cost, group.receive_s),
        )
        for i in range(group.decode)
    ]
    placer = DecodePlacer(group.placement)
    rates = ImprovementRate(group.rate_table, group.improvement_rate, group.rate_window_s)
    pool = Pool.uniform([0.0] * group.prefill, group.per_node)
    pool_at = 0.0
    done: list[RequestTimes] = []
    rejected: list[tuple[int, str]] = []
    limit = group.config.max_model_len
    block = group.config.block_size
    capacity = group.config.num_blocks * block  # a decode instance's KV slots when empty
    # Requests no decode instance had room for on arrival, oldest first (the router's queue).
    waiting: collections.deque[tuple[int, TraceRequest]] = collections.deque()
    waking: set[int] = set()

    def admission(rep: SimReplica) -> DecodeAdmission:
        hooks = rep.hooks
        assert isinstance(hooks, DecodeHooks) and hooks.admission is not None
        return hooks.admission

    host = (
        SharedCores(loop, group.host_cores, group.host_gangs, beside=group.pool_beside)
        if group.host_cores is not None
        else None
    )
    pool_host = (
        SharedCores(loop, group.pool_cores, beside=group.pool_beside)
        if group.pool_cores is not None
        else host
    )  # where the pool's chunks run (None: a device per rank)
    slots = [_Slots(group.slots) for _ in decodes]
    # Each prefill instance's requests in the order it got them (host_cores or pool_cores).
    queues: list[collections.deque[_Prefill]] = [collections.deque() for _ in range(group.prefill)]

    stepping: set[int] = set()  # the decode instances with a step computing

    def stepping_is(rep: SimReplica, busy: bool) -> None:
        # Pinned apart, the pool's chunks are in company while a decode step computes (on
        # shared cores the step is a task beside them).
        (stepping.add if busy else stepping.discard)(rep.index)
        if pool_host is not None and pool_host is not host:
            pool_host.set_outside_busy(bool(stepping))

    def start(rep: SimReplica) -> None:
        finish = rep.launch(loop.now)
        stepping_is(rep, finish is not None)
        if finish is None:
            return
        if host is None:
            loop.at(finish, functools.partial(end, rep))
        else:  # the step's cost is its work; the shared cores decide how long it takes
            host.run(finish - loop.now, group.decode_tp, functools.partial(end, rep))

    def next_chunk(run: _Prefill) -> None:
        # The chunk starts once each instance of its group has reached this request (ended
        # every request it got before) and the chunk before it is done (``running`` is False).
        chunk = run.chunks[run.done]
        if run.running or any(queues[m][0] is not run for m in chunk.group):
            return
        run.running = True
        assert pool_host is not None
        ranks = len(chunk.group) * group.prefill_tp
        if group.pool_cores is not None:
            ranks = min(ranks, group.pool_cores)
        pool_host.run(chunk.seconds, ranks, functools.partial(chunk_done, run), slowed=True)

    def chunk_done(run: _Prefill) -> None:
        run.running = False
        run.done += 1
        if run.done < len(run.chunks):
            next_chunk(run)
            return
        members = run.chunks[-1].group
        run.prefilled()
        for m in members:
            queues[m].popleft()
        for m in members:
            if queues[m]:
                next_chunk(queues[m][0])

    def later(delay: float, action: Callable[[], None]) -> None:
        loop.at(loop.now + delay, action)

    def grant(d: int) -> None:
        # The oldest waiting pieces, while slots are free: each piece's transfer, then the
        # decode leader's next step receives it.
        own = slots[d]
        while own.waiting and own.free:
            own.free -= 1
            own.waiting.popleft()()

    def offer(d: int, rid: str, pieces: list[int]) -> None:
        # A prefill has ended: its pieces handshake for slots, one each.
        for k, rows in enumerate(pieces):
            arrive_at = functools.partial(land, decodes[d], rid, rows, k)
            if group.handoff_is_work and pool_host is not None:
                send = functools.partial(pool_host.run, group.handoff_s(rows, 1), 1, arrive_at)
            else:
                send = functools.partial(later, group.handoff_s(rows, 1), arrive_at)
            slots[d].waiting.append(send)
        grant(d)

    def end(rep: SimReplica) -> None:
        hooks = rep.hooks
        assert isinstance(hooks, DecodeHooks)
        slots[rep.index].free += hooks.receiving  # landed: the leader's ``Landed``
        hooks.receiving = 0
        grant(rep.index)
        for rid, _, finished in rep.finish_step(loop.now):
            if finished:
                done.append(rep.times.pop(rid))
        admit()  # the step may have freed room for the oldest waiting requests
        start(rep)

    def wake(rep: SimReplica) -> None:
        waking.discard(rep.index)
        if rep.idle:
            start(rep)

    def land(rep: SimReplica, rid: str, rows: int, piece: int) -> None:
        # A piece's ``Receive`` reaches the decode leader: its next step receives it.
        admission(rep).receive(rid, 0, rows, piece, slot=0, xfer=0)
        hooks = rep.hooks
        assert isinstance(hooks, DecodeHooks)
        hooks.queued_rows.append(rows)
        if rep.idle and rep.index not in waking:
            waking.add(rep.index)
            loop.at(loop.now, functools.partial(wake, rep))

    def arrive(index: int, req: TraceRequest) -> None:
        need = req.prompt_tokens + req.output_tokens
        if need > limit:
            rejected.append(
                (index, f"{req.prompt_tokens} + {req.output_tokens} tokens exceed {limit}")
            )
            return
        if need > capacity:  # the router's 400 kv_capacity_exceeded
            rejected.append(
                (index, f"{need} KV slots: no decode instance holds more than {capacity}")
            )
            return
        waiting.append((index, req))
        admit()

    def admit() -> None:
        # Those that waited past the router's queue timeout were refused then (503).
        timeout = group.queue_timeout_s
        if timeout is not None and any(loop.now - r.arrival_s > timeout for _, r in waiting):
            for index, req in [w for w in waiting if loop.now - w[1].arrival_s > timeout]:
                waiting.remove((index, req))
                rejected.append((index, f"no decode instance had room within {timeout:g} s"))
        # The oldest waiting requests, while a decode instance has room for the oldest.
        while waiting and place(*waiting[0]):
            waiting.popleft()

    def place(index: int, req: TraceRequest) -> bool:
        """Place ``req`` and plan its prefill; False (nothing done) when no decode instance has
        room for it now."""
        nonlocal pool, pool_at
        loads = []
        for rep in decodes:
            adm = admission(rep)
            free = rep.blocks.num_free_blocks * block
            loads.append(DecodeLoad(free, len(rep.scheduler.running) + len(adm.incoming)))
        slots = req.prompt_tokens + req.output_tokens
        d = placer.choose(loads, slots)
        if d is None:
            return False
        rates.record_arrival(loop.now)  # as the router counts every request it plans
        rid = f"r{index}"
        rep = decodes[d]
        pool = pool.advance(loop.now - pool_at)
        pool_at = loop.now
        plan = plan_request(req.prompt_tokens, pool, group.rules, rates.current(loop.now))
        pieces = group.pieces(req.prompt_tokens, len(plan.chunks[-1].group))
        # Its times count from its arrival: the wait for room is part of its TTFT.
        rep.add(rid, req.arrival_s, req.prompt_tokens, req.output_tokens)
        try:
            admission(rep).expect(rid, len(pieces))
        except InvalidRequestError as exc:
            rep.times.pop(rid)
            rejected.append((index, str(exc)))
            return True
        pool = pool.commit((c.group, c.end) for c in plan.chunks)
        on_prefilled = functools.partial(offer, d, rid, pieces)
        if pool_host is None:
            loop.at(loop.now + plan.ttft, on_prefilled)
            return True
        run = _Prefill(plan.chunks, req.prompt_tokens, on_prefilled)
        for m in plan.chunks[-1].group:  # the last group holds every earlier one
            queues[m].append(run)
        next_chunk(run)
        return True

    for i, req in enumerate(trace):
        loop.at(req.arrival_s, functools.partial(arrive, i, req))
    loop.run()
    return SimResult.of(done, rejected, decodes)


def simulate_groups(groups: int, group: TetrisGroupSim, trace: Sequence[TraceRequest]) -> SimResult:
    """``groups`` identical Tetris groups, the arrivals dealt to them in turn (the router's
    round of groups)."""
    parts = [simulate_tetris(group, trace[g::groups]) for g in range(groups)]
    if groups == 1:
        return parts[0]
    requests: list[RequestTimes] = []
    rejected: list[tuple[int, str]] = []
    for g, part in enumerate(parts):
        for r in part.requests:
            index = int(r.request_id[1:]) * groups + g
            requests.append(dataclasses.replace(r, request_id=f"r{index}"))
        rejected += [(i * groups + g, why) for i, why in part.rejected]
    requests.sort(key=lambda r: int(r.request_id[1:]))
    return SimResult(
        requests=requests,
        rejected=rejected,
        steps=[s for p in parts for s in p.steps],
        busy_s=[b for p in parts for b in p.busy_s],
        preemptions=sum(p.preemptions for p in parts),
    )
