"""Runs a StepPlan through the model on this rank; the leader gets the logits to sample from."""

from __future__ import annotations

from typing import Protocol

import torch
from gearshift.worker.engine.plan import StepPlan
from gearshift.worker.kv.cache import LayerKV
from gearshift.worker.model.llama import AttentionCore, LlamaForCausalLM


class Executor(Protocol):
    """What the engine drives: one forward pass per plan, logits back on the leader."""

    def execute(self, plan: StepPlan) -> torch.Tensor | None: ...

    def shutdown(self) -> None: ...


class ModelRunner:
    """One rank's model, KV cache and attention core."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[LayerKV],
        core: AttentionCore,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.core = core
        self.device = device

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        """fp32 logits [S, vocab] for ``plan.logits_indices`` on the group's first rank."""
        plan = plan.to(self.device)
        meta = plan.attention_metadata()
        hidden = self.model(plan.input_ids, plan.positions, self.kv_caches, meta, self.core)
        logits = self.model.compute_logits(hidden[plan.logits_indices])
        return None if logits is None else logits.float()

    def shutdown(self) -> None:
        self.kv_caches = []
