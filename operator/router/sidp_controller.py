"""The SiDP mode controller: when a group of replicas switches between WaS and CaS (SiDP §4.3).

It lives where every replica's batch is visible (the router). Each observation is one group
step's batch size per replica; AUTO switches the whole group WaS → CaS when the mean batch per
replica over the last ``window_steps`` observations falls below ``cas_enter_batch_size``, and
back when it reaches ``was_enter_batch_size`` (hysteresis: the first must be below the second),
never twice within ``min_dwell_steps`` (coarse-grained switching). ``mode: WAS|CAS`` pins the
group. Parameters are live (Admin ApplyPolicy hands the new ``SidpPolicy`` message to
``update``). The decision is handed to ``apply``, which tells the group (the worker side makes
it take effect at one step boundary on every replica).

Serving, ``ServedGroupControl`` runs it for a group the router polls. A poll covers many steps:
from each replica's cumulative step and generated-token counters (``replica<r>_steps``,
``replica<r>_generation_tokens``) it derives how many group steps ran since the last poll and the
mean batch per replica over them (each running sequence emits one token per step), so
``window_steps`` and ``min_dwell_steps`` count engine steps, as the paper's do, however often the
router polls. The router hands a switch to the worker as a controller decision
(policy_control.py), which the group applies at one step boundary on every replica without
changing its configured ``mode``.
"""

from __future__ import annotations

import logging
import re
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from gearshift.v1 import policy_pb2
from gearshift.worker.policies.sidp.thresholds import (
    SOURCE_MEASURED,
    SOURCE_PROFILE,
    thresholds_from_profile,
)

__all__ = [
    "AUTO",
    "CAS",
    "WAS",
    "ControllerParameters",
    "ModeController",
    "ServedGroupControl",
    "thresholds_from_profile",
]
log = logging.getLogger(__name__)

WAS = policy_pb2.SidpPolicy.WAS
CAS = policy_pb2.SidpPolicy.CAS
AUTO = policy_pb2.SidpPolicy.AUTO
_COUNTER_KEY = re.compile(r"replica(\d+)_(steps|generation_tokens)")


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
    # The last window_steps steps as runs of (steps, mean batch per replica), oldest first.
    _window: deque[tuple[int, float]] = field(default_factory=deque)

    def __post_init__(self) -> None:
        self.params.check()
        if self.params.mode in (WAS, CAS):
            self.mode = self.params.mode
        self._since_switch = self.params.min_dwell_steps  # the first switch may come at once

    def update(self, params: ControllerParameters) -> None:
        """Live parameters (ApplyPolicy); a new pin takes effect at the next observation."""
        params.check()
        self.params = params
        self._trim()

    def observe(self, batch_sizes: Sequence[int]) -> int | None:
        """One group step's batch size per replica; the new mode when the group switches."""
        return self.observe_steps(1, sum(batch_sizes) / max(1, len(batch_sizes)))

    def observe_steps(self, steps: int, mean_batch: float) -> int | None:
        """``steps`` group steps whose batch per replica averaged ``mean_batch``; the new mode
        when the group switches (decided once, after them)."""
        if steps <= 0:
            return None
        self.steps += steps
        self._since_switch += steps
        self._window.append((steps, mean_batch))
        self._trim()
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
        if self._since_switch < p.min_dwell_steps or self._held() < p.window_steps:
            return None
        mean = self.mean_batch()
        if self.mode == WAS and mean < p.cas_enter_batch_size:
            return CAS
        if self.mode == CAS and mean >= p.was_enter_batch_size:
            return WAS
        return None

    def _held(self) -> int:
        return sum(n for n, _ in self._window)

    def _trim(self) -> None:
        """Keep exactly the last window_steps steps (the oldest run may be cut)."""
        excess = self._held() - self.params.window_steps
        while excess > 0 and self._window:
            n, mean = self._window[0]
            if n <= excess:
                self._window.popleft()
                excess -= n
            else:
                self._window[0] = (n - excess, mean)
                excess = 0

    def mean_batch(self) -> float:
        held = self._held()
        return sum(n * m for n, m in self._window) / held if held else 0.0


def replica_counters(policy_stats: Mapping[str, float]) -> dict[int, tuple[int, int]]:
    """Each replica's cumulative (steps, generated tokens) from a served group's stats."""
    found: dict[int, dict[str, int]] = {}
    for key, value in policy_stats.items():
        m = _COUNTER_KEY.fullmatch(key)
        if m:
            found.setdefault(int(m.group(1)), {})[m.group(2)] = int(value)
    return {
        r: (c["steps"], c["generation_tokens"])
        for r, c in sorted(found.items())
        if "steps" in c and "generation_tokens" in c
    }


def steps_between(
    before: Mapping[int, tuple[int, int]], after: Mapping[int, tuple[int, int]]
) -> tuple[int, float] | None:
    """(group steps, mean batch per replica) between two polls of the replicas' counters, or
    None when they are not comparable (other replicas, or a counter went back: a restart).

    A group step is one step of the busiest replica (in CaS all replicas step together; in WaS
    an idle replica does not step, and counts as batch 0): the mean batch per replica is the
    tokens all replicas generated over (replicas × group steps)."""
    if not after or before.keys() != after.keys():
        return None
    deltas = [(after[r][0] - before[r][0], after[r][1] - before[r][1]) for r in after]
    if any(ds < 0 or dt < 0 for ds, dt in deltas):
        return None
    steps = max(ds for ds, _ in deltas)
    if steps == 0:
        return 0, 0.0
    return steps, sum(dt for _, dt in deltas) / (len(deltas) * steps)


@dataclass
class ServedGroupControl:
    """The controller of one served group, fed by the router's stats polls: each poll adds the
    group steps that ran since the previous one. Only AUTO decides; a pin reaches the worker
    through Admin ApplyPolicy itself. Returns the mode to hand the group, if it switches."""

    controller: ModeController | None = None
    _last: dict[int, tuple[int, int]] = field(default_factory=dict)
    # Why AUTO pins WaS on this group (its measured or profiled CaS never won), else empty.
    pinned_why: str = ""

    def observe(self, policy: policy_pb2.Policy, policy_stats: Mapping[str, float]) -> int | None:
        counters = replica_counters(policy_stats)
        before, self._last = self._last, counters
        if policy.WhichOneof("kind") != "sidp" or not counters:
            self.controller = None
            return None
        params = _worker_thresholds(ControllerParameters.from_proto(policy.sidp), policy_stats)
        if params.mode != AUTO:
            self.controller = None  # pinned: the worker runs the pin, nothing to decide
            return None
        if policy_stats.get("sidp_auto_pins_was", 0.0) == 1.0:
            return self._pin_was(policy_stats)
        self.pinned_why = ""
        if self.controller is None:
            current = int(policy_stats.get("sidp_mode", WAS))
            self.controller = ModeController(params, apply=lambda _: None, mode=current)
        else:
            self.controller.update(params)
        span = steps_between(before, counters)
        if span is None:
            return None  # the first poll (or after a restart): counters to compare with next
        return self.controller.observe_steps(*span)

    def decide(
        self, policy: policy_pb2.Policy, policy_stats: Mapping[str, float]
    ) -> policy_pb2.Policy | None:
        """``observe``'s switch as the ApplyPolicy message that carries it to the worker."""
        mode = self.observe(policy, policy_stats)
        if mode is None:
            return None
        return policy_pb2.Policy(sidp=policy_pb2.SidpPolicy(mode=mode))  # type: ignore[arg-type]

    def _pin_was(self, policy_stats: Mapping[str, float]) -> int | None:
        """AUTO on a group where CaS never won: WaS, whatever the batch (§4.3's B_th is below
        every batch measured); a group still in CaS (a pin before AUTO) is switched back."""
        self.controller = None
        why = "AUTO pins WaS: CaS was not faster at any batch size " + _where(policy_stats)
        if why != self.pinned_why:
            log.warning("sidp: %s", why)
            self.pinned_why = why
        return WAS if int(policy_stats.get("sidp_mode", WAS)) == CAS else None


def _where(policy_stats: Mapping[str, float]) -> str:
    source = int(policy_stats.get("sidp_thresholds_source", 0))
    return "measured at start-up" if source == SOURCE_MEASURED else "in the profile file"


def _worker_thresholds(
    params: ControllerParameters, policy_stats: Mapping[str, float]
) -> ControllerParameters:
    """The thresholds the group measured at start-up or read from a profile (its
    ``sidp_cas_enter_batch_size``/``sidp_was_enter_batch_size`` figures) in place of the
    policy's defaults; thresholds the policy sets are reported as explicit and kept."""
    source = int(policy_stats.get("sidp_thresholds_source", 0))
    cas = policy_stats.get("sidp_cas_enter_batch_size")
    was = policy_stats.get("sidp_was_enter_batch_size")
    if source not in (SOURCE_MEASURED, SOURCE_PROFILE) or cas is None or was is None:
        return params
    return replace(params, cas_enter_batch_size=int(cas), was_enter_batch_size=int(was))
