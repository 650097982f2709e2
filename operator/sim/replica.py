"""One simulated worker group: the engine's own ``Scheduler`` and ``BlockManager`` against
simulated time, with each step's duration from the cost model.

A step takes ``cost.step_time(batch)``, and at its end the sequences advance exactly as
``LLMEngine._finish`` advances them (computed tokens, then one sampled token for every sequence
whose prompt is done), so batching, chunked prefill, KV block allocation and preemption are the
engine's, not a copy.

Pipeline micro-batches follow ``LLMEngine.step``: the replica keeps up to ``micro_batches`` steps
in flight, each scheduled with the in-flight sequences left out (the engine's ``busy``), and
finishes the oldest; when it finishes, new steps are launched before the next oldest is waited
for. A step's cost is its whole trip through the pipeline (what ``gearshift profile`` times for a
lone micro-batch); each of ``stages`` stages holds it for its share (equal, or the model's
``ModelDesc.stage_shares``: every token runs each stage's layers, and the rows that sample also
run the LM head on the last stage, so a decode step leans on the last stage far more than a
prefill chunk does), and a micro-batch enters a stage once it has left the one before and the
micro-batch before it has left this one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

from gearshift.operator.sim.blocks import SimBlockManager
from gearshift.operator.sim.cost_model import StepCost
from gearshift.operator.sim.model_desc import StageShares
from gearshift.worker.engine.contract import QueueView, StepKind, StepRequest
from gearshift.worker.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from gearshift.worker.engine.sequence import FinishReason, Sequence
from gearshift.worker.kv.block_manager import BlockManager

if TYPE_CHECKING:
    from gearshift.worker.sampling.params import SamplingParams


class SimHooks(Protocol):
    """A policy whose leader shapes every step (the engine's ``Policy`` calls, in its order:
    ``step_request``, ``held``, then ``step_submitted``), its pipeline depth changing with its
    gear, and each step priced by the gear it runs on (``trip`` seconds over ``stages``). An
    empty batch may still cost time (a re-shard, KV copies): ``step_time`` says how much.
    ``barrier`` (asked after ``step_time``): the step starts with a barrier of every rank (a
    synchronous KV swap), so it enters the pipeline only once the micro-batches ahead of it
    have left the last stage."""

    def bind(self, scheduler: Scheduler, blocks: BlockManager) -> None: ...
    def step_request(self, queues: QueueView) -> StepRequest: ...
    def held(self) -> frozenset[str]: ...
    def step_submitted(self) -> None: ...
    def micro_batches(self) -> int: ...
    def step_time(self, batch: ScheduledBatch) -> tuple[float, int]: ...
    def barrier(self) -> bool: ...


@dataclass(frozen=True)
class ReplicaConfig:
    """The engine settings that shape scheduling (EngineConfig's names), and the KV size."""

    num_blocks: int
    block_size: int = 64
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048

    @classmethod
    def of_engine(cls, engine: Any) -> ReplicaConfig:
        """The settings a running ``LLMEngine`` schedules by (its KV blocks included)."""
        cfg = engine.scheduler.config
        return cls(
            num_blocks=engine.blocks.num_blocks,
            block_size=engine.blocks.block_size,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=cfg.max_model_len,
        )


@dataclass
class RequestTimes:
    """One request's simulated timeline (seconds)."""

    request_id: str
    arrival: float
    prompt_tokens: int
    output_tokens: int
    replica: int
    token_times: list[float] = field(default_factory=list)
    preemptions: int = 0

    @property
    def finished(self) -> float:
        return self.token_times[-1]

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None for one-token outputs)."""
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    @property
    def e2e(self) -> float:
        return self.finished - self.arrival


StepAsk = Callable[[QueueView], StepRequest]


@dataclass
class _Flight:
    batch: ScheduledBatch
    done: float  # when it leaves the last stage


class SimReplica:
    """A worker group's leader: its scheduler, its KV blocks, and the step being run."""

    def __init__(
        self,
        index: int,
        config: ReplicaConfig,
        cost: StepCost,
        step_request: StepAsk | None = None,
        micro_batches: int = 1,
        stages: int = 1,
        hooks: SimHooks | None = None,
        stage_shares: tuple[float, ...] | StageShares = (),
    ) -> None:
        if micro_batches < 1 or stages < 1:
            raise ValueError(
                f"micro_batches and stages must be >= 1, got {micro_batches}, {stages}"
            )
        valid = (
            stage_shares.valid()
            if isinstance(stage_shares, StageShares)
            else not stage_shares or min(stage_shares) >= 0
        )
        # With hooks the depth is the gear's (Seesaw): the shares serve the gear of their depth.
        if stage_shares and (not valid or (hooks is None and len(stage_shares) != stages)):
            raise ValueError(f"stage_shares {stage_shares} must be {stages} shares >= 0")
        self.index = index
        self.micro_batches = micro_batches
        self.stages = stages
        # Each stage's share of a step's trip: fixed, or from the batch's tokens and sampled
        # rows (ModelDesc.stage_shares); empty: equal shares.
        self.stage_shares = stage_shares
        self.config = config
        self.cost = cost
        self.step_request = step_request or (lambda _: StepRequest())
        # Traces carry lengths, not text: there is nothing a prefix cache could match.
        # The engine's manager, its per-block state made only for blocks handed out (blocks.py).
        self.blocks = SimBlockManager(
            config.num_blocks,
            config.block_size,
            config.max_num_seqs,
            -(-config.max_model_len // config.block_size),
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len
            ),
            self.blocks,
        )
        self.in_flight: deque[_Flight] = deque()
        self._stage_free: list[float] = []  # when each stage can take the next micro-batch
        self.times: dict[str, RequestTimes] = {}
        self.steps = 0
        self.busy_s = 0.0
        self.clock = 0.0  # where decode_step left this replica's time
        self.hooks = hooks
        if hooks is not None:
            hooks.bind(self.scheduler, self.blocks)

    def add(self, rid: str, arrival: float, prompt_tokens: int, output_tokens: int) -> None:
        self.times[rid] = RequestTimes(rid, arrival, prompt_tokens, output_tokens, self.index)
        seq = Sequence(
            request_id=rid,
            prompt_token_ids=[0] * prompt_tokens,
            # Sampling parameters only matter to the sampler, which the simulator does not run.
            params=cast("SamplingParams", None),
            max_tokens=output_tokens,
            arrival_time=arrival,
        )
        self.scheduler.add(seq)

    def launch(self, now: float) -> float | None:
        """Launch steps at ``now`` until ``micro_batches`` are in flight (or nothing is left to
        schedule); when the oldest in-flight step ends, or None when none is in flight."""
        while len(self.in_flight) < self._depth() and self._launch_one(now):
            pass
        return self.in_flight[0].done if self.in_flight else None

    def _depth(self) -> int:
        return self.hooks.micro_batches() if self.hooks is not None else self.micro_batches

    def _launch_one(self, now: float) -> bool:
        busy = frozenset(s.request_id for f in self.in_flight for s in _seqs(f.batch))
        queues = QueueView(
            len(self.scheduler.running), len(self.scheduler.waiting), len(self.in_flight)
        )
        hooks = self.hooks
        barrier = False
        if hooks is None:
            batch = self.scheduler.schedule(self.step_request(queues), busy)
            trip, stages = (0.0, self.stages) if batch.is_empty else (
                self.cost.step_time(batch), self.stages
            )  # fmt: skip
        else:
            ask = hooks.step_request(queues)
            batch = self.scheduler.schedule(ask, busy | hooks.held())
            trip, stages = hooks.step_time(batch)  # before step_submitted clears its copies
            barrier = hooks.barrier()
            hooks.step_submitted()
        for seq in batch.preempted:
            self.times[seq.request_id].preemptions += 1
        if batch.is_empty and trip <= 0.0:
            return False
        shares = self._shares(batch, stages)
        if len(self._stage_free) != stages:  # a gear of another depth (Seesaw): drained first
            self._stage_free = [max(self._stage_free, default=0.0)] * stages
        # A micro-batch holds each stage for its share, in order, once the one before it left;
        # behind a barrier of every rank, only once the pipeline has drained.
        done = max(now, *self._stage_free) if barrier else now
        for s, share in enumerate(shares):
            done = max(done, self._stage_free[s]) + trip * share
            self._stage_free[s] = done
        self.in_flight.append(_Flight(batch, done))
        self.steps += 1
        self.busy_s += trip * max(shares)
        return True

    def _shares(self, batch: ScheduledBatch, stages: int) -> tuple[float, ...]:
        """Each stage's share of this step's trip (equal for a gear of another depth)."""
        shares = self.stage_shares
        if len(shares) != stages:
            return (1.0 / stages,) * stages
        if isinstance(shares, StageShares):
            return shares.for_batch(batch.num_tokens, sampled_rows(batch))
        return shares

    def finish_step(self, now: float) -> list[tuple[str, int, bool]]:
        """End the oldest in-flight step at ``now``: (request id, new tokens, finished) per
        progressed request, in the order the engine would report them."""
        return self._advance(self.in_flight.popleft().batch, now)

    def decode_step(self, now: float, horizon: float) -> list[tuple[str, int, bool]] | None:
        """Run and finish at once the step ``launch(now)`` would start, when it is a plain
        decode step (every running sequence decodes, nothing waits, no pipeline, no policy
        hooks) ending strictly before ``horizon``, the simulation's next event: nothing else
        can happen meanwhile, so the event queue is skipped (issue 30, item 5: most steps of a
        lightly loaded replica). Returns ``finish_step``'s report with ``self.clock`` at the
        step's end, or None (nothing run) when the step is any other kind."""
        running = self.scheduler.running
        n = len(running)
        cfg = self.config
        if (
            self.hooks is not None
            or self.in_flight
            or self.micro_batches != 1
            or self.stages != 1
            or len(self._stage_free) != 1
            or self.scheduler.waiting
            or not 0 < n <= min(cfg.max_num_seqs, cfg.max_num_batched_tokens)
        ):
            return None
        size = cfg.block_size
        grow = 0
        for seq in running:
            if seq.num_tokens - seq.num_computed_tokens != 1:
                return None  # a prefill chunk is left: the scheduler's step
            grow += seq.num_computed_tokens + 1 > len(seq.blocks.block_ids) * size
        ask = self.step_request(QueueView(n, 0, 0))
        if ask.kind in (StepKind.NONE, StepKind.PREFILL) or (ask.max_seqs or n) < n:
            return None
        if grow > self.blocks.num_free_blocks:
            return None  # KV pressure: preemption is the scheduler's
        batch = ScheduledBatch(decodes=list(running))
        trip = self.cost.step_time(batch)
        # _launch_one's arithmetic for one stage of share 1.0, so the times are the same floats.
        done = max(now, self._stage_free[0]) + trip * 1.0
        if not done < horizon:
            return None
        for seq in running:
            self.blocks.allocate(seq.blocks, seq.num_computed_tokens + 1)
        self._stage_free[0] = done
        self.steps += 1
        self.busy_s += trip * 1.0
        self.clock = done
        return self._advance(batch, done)

    def _advance(self, batch: ScheduledBatch, now: float) -> list[tuple[str, int, bool]]:
        """The engine's end of ``batch`` at ``now`` (LLMEngine._finish)."""
        sampled: list[Sequence] = []
        for seq in batch.decodes:
            seq.num_computed_tokens += 1
            sampled.append(seq)
        for seq, n in batch.prefills:
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                sampled.append(seq)
        out = []
        for seq in sampled:
            seq.append_token(0)
            self.times[seq.request_id].token_times.append(now)
            # The trace fixes the output length: a request ends at max tokens (or the context).
            done = (
                seq.num_output_tokens >= seq.max_tokens
                or seq.num_tokens >= self.config.max_model_len
            )
            if done:
                self.scheduler.finish(seq, FinishReason.LENGTH)
            out.append((seq.request_id, 1, done))
        self.scheduler.remove_finished()
        return out

    @property
    def idle(self) -> bool:
        return not self.in_flight


def sampled_rows(batch: ScheduledBatch) -> int:
    """Rows of a step that sample (the LM head's rows, ``plan.build_plan``'s logits rows):
    every decode, and each prompt chunk that reaches its prompt's end."""
    ends = sum(seq.num_computed_tokens + n == seq.num_tokens for seq, n in batch.prefills)
    return len(batch.decodes) + ends


def _seqs(batch: ScheduledBatch) -> list[Sequence]:
    return batch.decodes + [seq for seq, _ in batch.prefills]
