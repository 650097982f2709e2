"""Runs a StepPlan through one of this rank's gears; the leader gets the logits to sample from."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import torch

from gearshift.worker.engine.plan import StepPlan
from gearshift.worker.kv.cache import LayerKV
from gearshift.worker.model.llama import AttentionCore, LlamaForCausalLM
from gearshift.worker.parallel.comm import CommGroup


class Executor(Protocol):
    """What the engine drives: one forward pass per plan, logits back on the leader."""

    def execute(self, plan: StepPlan) -> torch.Tensor | None: ...

    def keepalive(self) -> None: ...

    def shutdown(self) -> None: ...


@dataclass
class Gear:
    """The model built for one layout on this rank (DESIGN.md: layouts and gears)."""

    name: str
    model: LlamaForCausalLM
    core: AttentionCore
    sp: CommGroup  # tokens of a step are split over this group (Ulysses); size 1: not split

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
    ) -> None:
        self.gears = gears
        self.kv_caches = kv_caches
        self.device = device
        self.threads = threads  # None: the process's thread count for every step

    @property
    def model(self) -> LlamaForCausalLM:
        return self.gears[0].model

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        """Logits [S, vocab] (model dtype) for ``plan.logits_indices`` on the group's first rank."""
        gear = self.gears[plan.gear]
        if self.threads is not None:
            self.threads.for_step(plan.num_tokens)
        plan = plan.to(self.device)
        meta = plan.attention_metadata()
        ids, positions = plan.input_ids, plan.positions
        sp = gear.sp
        if sp.size > 1:
            # Alg. 2 line 1: each SP rank runs the dense layers on its slice of the tokens.
            chunk = ids.shape[0] // sp.size
            ids = ids[sp.rank * chunk : (sp.rank + 1) * chunk]
            positions = positions[sp.rank * chunk : (sp.rank + 1) * chunk]
        hidden = gear.model(ids, positions, self.kv_caches, meta, gear.core)
        if sp.size > 1:
            # Line 13: the hidden states come together where the logits are made.
            gathered = sp.gather_to_first(hidden)
            if gathered is None:
                return None
            hidden = gathered
        # No fp32 copy here: the sampler upcasts only the rows and steps that need it.
        return gear.model.compute_logits(hidden[plan.logits_indices])

    def keepalive(self) -> None:
        """Nothing to keep alive in one process."""

    def shutdown(self) -> None:
        self.kv_caches = []
