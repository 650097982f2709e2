"""A policy decides, per step, which gear runs; the engine asks it and counts what it chose.

The policy's layout parameters (tp, sp, ...) are fixed for the life of a worker group; its live
parameters (Shift's threshold, ...) change at run time through ``update_live`` (the worker
server's ApplyPolicy; the proto marks which fields are live).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from gearshift.worker.errors import InvalidRequestError

LiveValue = int | float | str


class GearPolicy(ABC):
    """Which gear runs each step, and what a step of that gear needs."""

    kind: ClassVar[str]
    gear_names: tuple[str, ...]

    @abstractmethod
    def choose_gear(self, num_tokens: int) -> int:
        """Index into ``gear_names`` for a step of ``num_tokens`` scheduled tokens."""

    def pad_multiple(self, gear: int) -> int:
        """The token count of a step of ``gear`` is padded to a multiple of this (Ulysses SP)."""
        del gear
        return 1

    @abstractmethod
    def layout(self) -> dict[str, int]:
        """The fixed parallel sizes, e.g. {"tp": 1, "sp": 3}."""

    def live_parameters(self) -> dict[str, LiveValue]:
        """Parameters that may change while the group runs."""
        return {}

    def update_live(self, values: dict[str, LiveValue]) -> None:
        """Apply live parameters; refuses unknown names or bad values, changing nothing."""
        current = self.live_parameters()
        for name, value in values.items():
            if name not in current:
                raise InvalidRequestError(
                    f"{self.kind}.{name}", f"{self.kind}.{name} cannot be changed while running"
                )
            self._check_live(name, value)
        for name, value in values.items():
            setattr(self, name, value)

    def _check_live(self, name: str, value: LiveValue) -> None:
        del name, value


class StaticPolicy(GearPolicy):
    """One gear for every step."""

    kind = "static"

    def __init__(self, tp: int = 1, sp: int = 1, pp: int = 1) -> None:
        self.tp, self.sp, self.pp = tp, sp, pp
        self.gear_names = ("static",)

    def choose_gear(self, num_tokens: int) -> int:
        del num_tokens
        return 0

    def pad_multiple(self, gear: int) -> int:
        del gear
        return self.sp

    def layout(self) -> dict[str, int]:
        return {"tp": self.tp, "sp": self.sp, "pp": self.pp}
