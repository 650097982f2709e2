"""The SiDP mode controller: when a group of replicas switches between WaS and CaS (SiDP §4.3).

It lives where every replica's batch is visible (the router). Each observation is one group
step's batch size per replica; AUTO switches the whole group WaS → CaS when the mean batch per
replica over the last ``window_steps`` observations falls below ``cas_enter_batch_size``, and
back when it reaches ``was_enter_batch_size`` (hysteresis: the first must be below the second),
never twice within ``min_dwell_steps`` (coarse-grained switching). ``mode: WAS|CAS`` pins the
group. Parameters are live (Admin ApplyPolicy hands the new ``SidpPolicy`` message to
``update``). The decision is handed to ``apply``, which tells the group (the worker side makes
it take effect at one step boundary on every replica).

Serving, ``ServedGroupControl`` runs it for a group the router polls: one observation per stats
poll (each replica's running batch from ``WorkerStats.policy_stats``); the router hands a switch
to the worker as a controller decision (policy_control.py), which the group applies at one step
boundary on every replica without changing its configured ``mode``.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from gearshift.v1 import policy_pb2

WAS = policy_pb2.SidpPolicy.WAS
CAS = policy_pb2.SidpPolicy.CAS
AUTO = policy_pb2.SidpPolicy.AUTO
_BATCH_KEY = re.compile(r"replica(\d+)_batch")


class InvalidControllerParameters(ValueError):
    """A parameter set the controller refuses (names the field)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name


@dataclass(frozen=True)
class ControllerParameters:
    """The live fields of SidpPolicy the controller reads."""

    mode: int = AUTO
    cas_enter_batch_size: int = 32
    was_enter_batch_size: int = 64
    window_steps: int = 32
    min_dwell_steps: int = 256

    @staticmethod
    def from_proto(msg: policy_pb2.SidpPolicy) -> ControllerParameters:
        params = ControllerParameters(
            mode=int(msg.mode) or AUTO,
            cas_enter_batch_size=int(msg.cas_enter_batch_size),
            was_enter_batch_size=int(msg.was_enter_batch_size),
            window_steps=int(msg.window_steps),
            min_dwell_steps=int(msg.min_dwell_steps),
        )
        params.check()
        return params

    def check(self) -> None:
        if self.was_enter_batch_size <= self.cas_enter_batch_size:
            raise InvalidControllerParameters(
                "sidp.was_enter_batch_size",
                "sidp.was_enter_batch_size must be above sidp.cas_enter_batch_size",
            )
        if self.window_steps < 1:
            raise InvalidControllerParameters(
                "sidp.window_steps", "sidp.window_steps must be at least 1"
            )


@dataclass
class ModeController:
    """Decides the group's mode from per-step batch sizes; ``apply`` carries out a switch."""

    params: ControllerParameters
    apply: Callable[[int], None]
    mode: int = WAS  # AUTO starts in WaS
    switches: int = 0
    steps: int = 0
    _since_switch: int = 0
    _window: deque[float] = field(default_factory=deque)

    def __post_init__(self) -> None:
        self.params.check()
        if self.params.mode in (WAS, CAS):
            self.mode = self.params.mode
        self._window = deque(maxlen=self.params.window_steps)
        self._since_switch = self.params.min_dwell_steps  # the first switch may come at once

    def update(self, params: ControllerParameters) -> None:
        """Live parameters (ApplyPolicy); a new pin takes effect at the next observation."""
        params.check()
        self.params = params
        self._window = deque(self._window, maxlen=params.window_steps)

    def observe(self, batch_sizes: Sequence[int]) -> int | None:
        """One group step's batch size per replica; the new mode when the group switches."""
        self.steps += 1
        self._since_switch += 1
        self._window.append(sum(batch_sizes) / max(1, len(batch_sizes)))
        target = self._target()
        if target is None or target == self.mode:
            return None
        self.mode = target
        self.switches += 1
        self._since_switch = 0
        self.apply(target)
        return target

    def _target(self) -> int | None:
        p = self.params
        if p.mode in (WAS, CAS):
            return p.mode  # a pin is obeyed at once, dwell or not
        if self._since_switch < p.min_dwell_steps or len(self._window) < p.window_steps:
            return None
        mean = sum(self._window) / len(self._window)
        if self.mode == WAS and mean < p.cas_enter_batch_size:
            return CAS
        if self.mode == CAS and mean >= p.was_enter_batch_size:
            return WAS
        return None

    def mean_batch(self) -> float:
        return sum(self._window) / len(self._window) if self._window else 0.0


def replica_batches(policy_stats: Mapping[str, float]) -> list[int]:
    """Each replica's running batch from a served group's stats (``replica<r>_batch``)."""
    found = {}
    for key, value in policy_stats.items():
        m = _BATCH_KEY.fullmatch(key)
        if m:
            found[int(m.group(1))] = int(value)
    return [found[r] for r in sorted(found)]


@dataclass
class ServedGroupControl:
    """The controller of one served group, fed by the router's stats polls (one observation per
    poll: the replicas' running batches). Only AUTO decides; a pin reaches the worker through
    Admin ApplyPolicy itself. Returns the mode to hand the group, if it switches."""

    controller: ModeController | None = None

    def observe(self, policy: policy_pb2.Policy, policy_stats: Mapping[str, float]) -> int | None:
        batches = replica_batches(policy_stats)
        if policy.WhichOneof("kind") != "sidp" or not batches:
            self.controller = None
            return None
        params = ControllerParameters.from_proto(policy.sidp)
        if params.mode != AUTO:
            self.controller = None  # pinned: the worker runs the pin, nothing to decide
            return None
        if self.controller is None:
            current = int(policy_stats.get("sidp_mode", WAS))
            self.controller = ModeController(params, apply=lambda _: None, mode=current)
        else:
            self.controller.update(params)
        return self.controller.observe(batches)

    def decide(
        self, policy: policy_pb2.Policy, policy_stats: Mapping[str, float]
    ) -> policy_pb2.Policy | None:
        """``observe``'s switch as the ApplyPolicy message that carries it to the worker."""
        mode = self.observe(policy, policy_stats)
        if mode is None:
            return None
        return policy_pb2.Policy(sidp=policy_pb2.SidpPolicy(mode=mode))  # type: ignore[arg-type]
