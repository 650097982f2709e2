"""Runs a StepPlan through one of this rank's gears; the leader gets the logits to sample from.

The engine drives an ``Executor``: ``submit`` starts a step and returns a handle whose
``result`` is the step's logits on the leader. In one process (and in a group without pipeline
stages) the step is done when ``submit`` returns; a pipeline's leader returns as soon as its own
stage has run, so the engine can start the next micro-batch while later stages work, and
``result`` receives the logits from the last stage (DESIGN.md: step contract).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TextIO

import torch

from gearshift.worker.attention.core import AttentionCore
from gearshift.worker.attention.metadata import AttentionMetadata
from gearshift.worker.comm import CommGroup
from gearshift.worker.engine.graph_runner import DecodeGraphs
from gearshift.worker.engine.plan import StepPlan
from gearshift.worker.kv.cache import LayerKV
from gearshift.worker.model.llama import LlamaForCausalLM
from gearshift.worker.parallel.pipeline import PipelineStage


class StepHandle(Protocol):
    """A submitted step: ``result`` is its logits [S, vocab] on the leader."""

    def result(self) -> torch.Tensor: ...


@dataclass
class Done:
    """A step that finished inside ``submit``."""

    logits: torch.Tensor

    def result(self) -> torch.Tensor:
        return self.logits


class Executor(Protocol):
    """What the engine drives: steps submitted in order, their logits back on the leader."""

    def submit(self, plan: StepPlan) -> StepHandle: ...

    def keepalive(self) -> None: ...

    def shutdown(self) -> None: ...


class RankHook(Protocol):
    """A policy's own work on every rank, in plan order (DESIGN.md: step contract): e.g. moving
    KV named by the plan's sections, or loading another gear's weights before that gear runs."""

    def before_step(self, runner: ModelRunner, plan: StepPlan) -> None:
        """Runs before the plan's forward pass (also for a plan without tokens)."""
        ...

    def close(self) -> None:
        """The group ends: release what the hook holds (threads, shared memory)."""
        ...


def execute(executor: Executor, plan: StepPlan) -> torch.Tensor:
    """Run one step to completion (tools and tests that do not pipeline)."""
    return executor.submit(plan).result()


@dataclass
class Gear:
    """The model built for one layout on this rank (DESIGN.md: layouts and gears)."""

    name: str
    model: LlamaForCausalLM
    core: AttentionCore
    sp: CommGroup  # tokens of a step are split over this group (Ulysses); size 1: not split
    stage: PipelineStage | None = None  # this rank's pipeline stage; None: the whole model

    def weight_bytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for p in self.model.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
        return total


# Steps of at least this many tokens are compute-bound (a 2,048-token prefill step of SmolLM2 takes
# ~0.7 s on one core, a 32-sequence decode step ~30 ms): they get EngineConfig.prefill_threads.
PREFILL_THREADS_MIN_TOKENS = 256


class StepThreads:
    """Torch CPU threads per step: ``base`` (what the process was given) for small steps,
    ``prefill`` for steps of at least ``min_tokens`` tokens.

    On a machine shared with the router, decode steps leave a core to the processes that stream
    tokens; a long prefill step has nothing to stream until it ends, so it may use that core too
    (a 16 x 128-token SmolLM2 prefill: 690 ms on one thread, 380 ms on two).
    """

    def __init__(self, prefill: int, min_tokens: int = PREFILL_THREADS_MIN_TOKENS) -> None:
        self.base = torch.get_num_threads()
        if hasattr(os, "sched_getaffinity"):
            # A rank pinned to its cores (launch.bind_rank_cores) must not oversubscribe them.
            prefill = min(prefill, max(self.base, len(os.sched_getaffinity(0))))
        self.prefill = prefill
        self.min_tokens = min_tokens
        self.current = self.base

    def for_step(self, num_tokens: int) -> int:
        want = self.prefill if num_tokens >= self.min_tokens else self.base
        if want != self.current:
            torch.set_num_threads(want)
            self.current = want
        return want


class ModelRunner:
    """This rank's gears and the KV cache they share."""

    def __init__(
        self,
        gears: list[Gear],
        kv_caches: list[LayerKV],
        device: torch.device,
        threads: StepThreads | None = None,
        hook: RankHook | None = None,
    ) -> None:
        self.gears = gears
        self.hook = hook
        self.kv_caches = kv_caches
        self.device = device
        self.threads = threads  # None: the process's thread count for every step
        # Step events for tests and debugging ($GEARSHIFT_STEP_TRACE): "<step> <micro-batch>
        # start|end <CLOCK_MONOTONIC ns>", one file per rank; the clock is the host's, so the
        # files of one host's ranks merge into one order of events.
        self.trace: TextIO | None = None
        self.closers: list[Callable[[], None]] = []  # the policy's per-rank resources
        # Decode-only steps of the gears it holds graphs for replay them (launch/rank_graphs).
        self.graphs: DecodeGraphs | None = None

    def _event(self, plan: StepPlan, what: str) -> None:
        if self.trace is not None:
            self.trace.write(f"{plan.step} {plan.micro_batch} {what} {time.monotonic_ns()}\n")

    @property
    def model(self) -> LlamaForCausalLM:
        return self.gears[0].model

    def submit(self, plan: StepPlan) -> StepHandle:
        """One process: the step is done when this returns."""
        logits = self.execute(plan)
        assert logits is not None, "a one-process runner always holds the logits"
        return Done(logits)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        """Logits [S, vocab] (model dtype) for ``plan.logits_indices`` on the rank that makes
        them (the first rank of the last pipeline stage); None on every other rank. A
        pipeline's last stage sends them on to the leader when the leader is elsewhere."""
        self._event(plan, "start")
        try:
            return self._execute(plan)
        finally:
            self._event(plan, "end")

    def _execute(self, plan: StepPlan) -> torch.Tensor | None:
        if self.hook is not None:
            self.hook.before_step(self, plan)
        gear = self.gears[plan.gear]
        if plan.num_tokens == 0:
            # A plan that only carries the hook's work (sections): no forward, no logits rows.
            dtype = next(gear.model.parameters()).dtype
            return torch.empty((0, gear.model.config.vocab_size), dtype=dtype, device=self.device)
        if self.threads is not None:
            self.threads.for_step(plan.num_tokens)
        graphs = self.graphs
        bucket = graphs.bucket_for(plan) if graphs is not None else None
        if graphs is not None and bucket is not None:
            return graphs.replay(plan, bucket)
        # Host values are read before the plan moves to its device: no wait for the device.
        seq_lens = plan.seq_lens.tolist()
        plan = plan.to(self.device)
        meta = plan.attention_metadata(seq_lens)
        return self.forward(
            gear, plan.input_ids, plan.positions, self.kv_caches, meta, plan.logits_indices
        )

    def forward(
        self,
        gear: Gear,
        ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerKV],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """``gear``'s forward pass on this rank over every token of the step: the logits of
        ``logits_indices`` (None: every row) where they are made, None on other ranks. Eager
        steps and captured graphs (graph_runner) run this same code."""
        sp, stage, model = gear.sp, gear.stage, gear.model
        if sp.size > 1:
            # Alg. 2 line 1: each SP rank runs the dense layers on its slice of the tokens.
            chunk = ids.shape[0] // sp.size
            ids = ids[sp.rank * chunk : (sp.rank + 1) * chunk]
            positions = positions[sp.rank * chunk : (sp.rank + 1) * chunk]
        carry = None
        if stage is not None and not stage.is_first:
            dtype = next(model.parameters()).dtype
            carry = stage.recv_activations(
                ids.shape[0], model.config.hidden_size, dtype, self.device
            )
        hidden, residual = model.forward_layers(ids, positions, kv_caches, meta, gear.core, carry)
        if stage is not None and not stage.is_last:
            assert residual is not None
            stage.send_activations(hidden, residual)
            return None
        hidden = model.final_norm(hidden, residual)
        if sp.size > 1:
            # Line 13: the hidden states come together where the logits are made.
            gathered = sp.gather_to_first(hidden)
            if gathered is None:
                return None
            hidden = gathered
        # No fp32 copy here: the sampler upcasts only the rows and steps that need it.
        logits = model.compute_logits(hidden if logits_indices is None else hidden[logits_indices])
        if logits is not None and stage is not None and stage.logits_to is not None:
            if logits.shape[0]:  # the leader receives nothing for a step without logits rows
                stage.send_logits(logits)
            return None
        return logits

    def flush(self) -> None:
        """Wait for this rank's outstanding pipeline sends."""
        for gear in self.gears:
            if gear.stage is not None:
                gear.stage.flush()

    def keepalive(self) -> None:
        """Nothing to keep alive in one process."""

    def shutdown(self) -> None:
        self.kv_caches = []
        self.graphs = None
        closers, self.closers = self.closers, []
        for close in closers:
            close()
        if self.hook is not None:
            self.hook.close()
            self.hook = None
        if self.trace is not None:
            self.trace.close()
            self.trace = None
