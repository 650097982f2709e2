"""One simulated worker group: the engine's own ``Scheduler`` and ``BlockManager`` against
simulated time, with each step's duration from the cost model.

A step is scheduled when the replica is idle, takes ``cost.step_time(batch)``, and at its end the
sequences advance exactly as ``LLMEngine._finish`` advances them (computed tokens, then one
sampled token for every sequence whose prompt is done), so batching, chunked prefill, KV block
allocation and preemption are the engine's, not a copy. One step in flight per replica (no
pipeline micro-batches yet).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from gearshift.operator.sim.cost_model import StepCost
from gearshift.worker.engine.contract import QueueView, StepRequest
from gearshift.worker.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from gearshift.worker.engine.sequence import FinishReason, Sequence
from gearshift.worker.kv.block_manager import BlockManager

if TYPE_CHECKING:
    from gearshift.worker.sampling.params import SamplingParams


@dataclass(frozen=True)
class ReplicaConfig:
    """The engine settings that shape scheduling (EngineConfig's names), and the KV size."""

    num_blocks: int
    block_size: int = 64
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048


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


class SimReplica:
    """A worker group's leader: its scheduler, its KV blocks, and the step being run."""

    def __init__(
        self,
        index: int,
        config: ReplicaConfig,
        cost: StepCost,
        step_request: StepAsk | None = None,
    ) -> None:
        self.index = index
        self.config = config
        self.cost = cost
        self.step_request = step_request or (lambda _: StepRequest())
        # Traces carry lengths, not text: there is nothing a prefix cache could match.
        self.blocks = BlockManager(
            config.num_blocks,
            config.block_size,
            config.max_num_seqs,
            -(-config.max_model_len // config.block_size),
            enable_prefix_caching=False,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len
            ),
            self.blocks,
        )
        self.batch: ScheduledBatch | None = None
        self.times: dict[str, RequestTimes] = {}
        self.steps = 0
        self.busy_s = 0.0

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

    def start_step(self) -> float | None:
        """Schedule the next step; its duration, or None when there is nothing to run."""
        assert self.batch is None, "one step at a time"
        queues = QueueView(len(self.scheduler.running), len(self.scheduler.waiting), 0)
        batch = self.scheduler.schedule(self.step_request(queues))
        for seq in batch.preempted:
            self.times[seq.request_id].preemptions += 1
        if batch.is_empty:
            return None
        self.batch = batch
        duration = self.cost.step_time(batch)
        self.steps += 1
        self.busy_s += duration
        return duration

    def finish_step(self, now: float) -> list[tuple[str, int, bool]]:
        """End the running step at ``now``: (request id, new tokens, finished) per progressed
        request, in the order the engine would report them."""
        batch, self.batch = self.batch, None
        assert batch is not None
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
        return self.batch is None
