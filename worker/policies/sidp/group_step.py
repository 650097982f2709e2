"""The mode of every step, the same on every replica (SiDP §4.3: the group switches as one).

The controller writes a mode request into the group's rendezvous store under a growing epoch
(``request_mode``). In WaS the replicas run independently; one that sees a new epoch at a step
boundary enters a switch exchange, which every other replica joins at its own next boundary (idle
ones poll), and all adopt the newest epoch's mode from the same point. In CaS the replicas step
together: every step starts with one small all-gather (the step's control message) carrying each
replica's row count (so owners skip idle replicas) and the epoch it has seen; a mode change there
applies to that very step on every replica. Each step's mode tag is recorded for tests and stats.
Only a replica's leading rank takes part; with tp > 1 it tells its TP followers each decision
(``followers.py``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gearshift.worker.comm import CommGroup
from gearshift.worker.engine.contract import IdleResult
from gearshift.worker.policies.sidp.cas import CasExchange
from gearshift.worker.policies.sidp.ffn import FfnService, Mode
from gearshift.worker.policies.sidp.followers import SendToFollowers, step_plan

EPOCH_KEY = "sidp/epoch"
_COUNTER_KEY = "sidp/epochs"


def _mode_key(epoch: int) -> str:
    return f"sidp/mode/{epoch}"


def request_mode(store: Any, mode: Mode) -> int:
    """Ask the whole group to run ``mode`` from its next common step boundary; the epoch."""
    epoch = int(store.add(_COUNTER_KEY, 1))
    store.set(_mode_key(epoch), str(int(mode)))
    store.set(EPOCH_KEY, str(epoch))
    return epoch


def applied_epochs(store: Any, replicas: int) -> list[int]:
    """The newest epoch each replica has switched to (0 before any): the controller's way to
    see a requested switch take effect."""
    out = []
    for r in range(replicas):
        key = f"sidp/applied/{r}"
        out.append(int(store.get(key)) if store.check([key]) else 0)
    return out


@dataclass
class GroupStep:
    """One replica's view of the group's step boundaries (the launcher's ReplicaSync)."""

    service: FfnService
    cas: CasExchange
    world: CommGroup  # the replicas' leading ranks, group rank = replica
    store: Any
    initial: Mode  # the mode of epoch 0 (the policy's ``mode``)
    epoch: int = 0
    switches: int = 0
    group_steps: int = 0  # CaS steps: numbered the same on every replica
    # (switches so far, mode, CaS group step or -1) of the recent steps this replica ran or
    # joined with work somewhere in the group.
    tags: deque[tuple[int, int, int]] = field(default_factory=lambda: deque(maxlen=8192))
    followers: SendToFollowers | None = None  # this replica's TP followers (tp > 1)

    def __post_init__(self) -> None:
        self._all_stopping = False

    @property
    def mode(self) -> Mode:
        return self.service.mode

    def _seen(self) -> int:
        if not self.store.check([EPOCH_KEY]):
            return 0
        return int(self.store.get(EPOCH_KEY))

    def _apply(self, epoch: int) -> None:
        mode = self.initial if epoch == 0 else Mode(int(self.store.get(_mode_key(epoch))))
        self.epoch = epoch
        self.store.set(f"sidp/applied/{self.world.rank}", str(epoch))
        if self.service.set_mode(mode):
            self.switches += 1

    def _gather(self, values: list[int]) -> torch.Tensor:
        mine = torch.tensor(values, dtype=torch.int64)
        if self.world.size == 1:
            return mine.view(1, -1)
        parts = [torch.empty_like(mine) for _ in range(self.world.size)]
        dist.all_gather(parts, mine, group=self.world.group)
        return torch.stack(parts)

    def _boundary(self, rows: int, stopping: bool = False) -> bool:
        """Agree on this step's mode; True when it is a CaS step (rows exchanged)."""
        if self.service.mode == Mode.WAS:
            seen = self._seen()
            if seen == self.epoch:
                return False
            agreed = int(self._gather([seen])[:, 0].max())
            self._apply(agreed)
            if self.service.mode == Mode.WAS:
                return False
        header = self._gather([self._seen(), rows, int(stopping)])
        self._all_stopping = bool(header[:, 2].all())
        agreed = int(header[:, 0].max())
        if agreed != self.epoch:
            self._apply(agreed)
            if self.service.mode == Mode.WAS:
                return False
        self.cas.begin_step(header[:, 1].tolist())
        self.group_steps += 1
        return True

    def _tell(self, cas_step: bool, dummy: bool) -> None:
        if self.followers is not None:
            self.followers(step_plan(self.mode, cas_step, dummy, self.cas.rows))

    def before_step(self, num_tokens: int) -> None:
        """Called by the replica before each step it runs."""
        cas_step = self._boundary(num_tokens)
        self._tell(cas_step, dummy=False)
        self.tags.append((self.switches, int(self.mode), self.group_steps if cas_step else -1))

    def idle(self, stopping: bool) -> IdleResult:
        """An idle replica at a boundary: in CaS it joins the group's step, running a dummy step
        (serving the layers it owns) when another replica has work."""
        if not self._boundary(0, stopping):
            return IdleResult.STOP if stopping else IdleResult.WAIT
        if self._all_stopping:
            return IdleResult.STOP
        if any(self.cas.rows):
            self.tags.append((self.switches, int(self.mode), self.group_steps))
            self._tell(cas_step=True, dummy=True)
            self.cas.dummy_step()
            return IdleResult.BUSY
        return IdleResult.WAIT

    def stats(self) -> dict[str, Any]:
        return {"mode": int(self.mode), "switches": self.switches, "tags": list(self.tags)}
