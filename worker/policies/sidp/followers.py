"""A replica's TP followers run each step in the mode their leader agreed (SiDP with tp > 1).

Only a replica's leading rank (TP rank 0) meets the other replicas at step boundaries
(``group_step.py``). It tells its TP followers what was agreed over the replica's control
channel, as a plan without tokens carrying one section: the step's mode, whether it is a CaS step,
whether it is a dummy step, and every replica's rows. A follower applies it in its rank hook
before the step's own plan arrives, so all dp × tp ranks run a step in one mode, and an idle
replica's followers join its dummy steps (serving their shards of the layers it owns).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gearshift.worker.engine.plan import StepPlan
from gearshift.worker.policies.sidp.cas import CasExchange
from gearshift.worker.policies.sidp.ffn import FfnService, Mode

SECTION = "sidp"
# What the launcher gives a replica's leader: send one plan to its TP followers.
SendToFollowers = Callable[[StepPlan], None]


def step_plan(mode: Mode, cas_step: bool, dummy: bool, rows: list[int]) -> StepPlan:
    """The tokenless plan that carries one boundary's decision to the followers."""
    empty = torch.empty(0, dtype=torch.int64)
    plan = StepPlan(
        step=-1,
        gear=0,
        input_ids=empty,
        positions=empty,
        slot_mapping=empty,
        block_tables=torch.empty((0, 0), dtype=torch.int64),
        seq_lens=empty,
        logits_indices=empty,
        num_decodes=0,
        prefill_query_lens=(),
    )
    values = [int(mode), int(cas_step), int(dummy), *rows]
    return plan.with_section(SECTION, torch.tensor(values, dtype=torch.int64))


@dataclass
class FollowerHook:
    """A TP follower's rank hook: apply the leader's decision before the step runs."""

    service: FfnService
    cas: CasExchange

    def before_step(self, runner: Any, plan: StepPlan) -> None:
        del runner
        section = plan.section(SECTION)
        if section is None:
            return  # the step's own plan: its decision came just before
        mode, cas_step, dummy, *rows = section.tolist()
        self.service.set_mode(Mode(mode))
        if cas_step:
            self.cas.begin_step(rows)
        if dummy:
            self.cas.dummy_step()

    def close(self) -> None:
        """The policy's closers release the housekeeper and buffers."""
