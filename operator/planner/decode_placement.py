"""Which decode instance a prefilled request goes to (Tetris §5.2).

FREENESS (the paper's): the highest freeness rate, free KV slots net of the slots of requests
whose KV is still in flight ("virtual usage", after Llumnix) over the active batch size.
LEAST_LOADED takes the fewest active requests, ROUND_ROBIN the next instance in turn. An
instance without room for the request is never chosen; with none, the request waits (the
router's ``room_queue.py``, oldest first; the simulator's ``tetris_sim.py`` alike).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass


class Placement(enum.Enum):
    """The proto's TetrisPolicy.DecodePlacement (PLACEMENT_UNSPECIFIED means FREENESS)."""

    FREENESS = 1
    LEAST_LOADED = 2
    ROUND_ROBIN = 3


@dataclass(frozen=True)
class DecodeLoad:
    """One decode instance as last reported, plus the transfers the router has sent it since."""

    free_slots: int  # KV slots not held by admitted requests
    active: int  # requests in its running batch
    in_flight_slots: int = 0  # virtual usage: slots of requests whose KV is still arriving

    @property
    def available(self) -> int:
        return self.free_slots - self.in_flight_slots

    @property
    def freeness(self) -> float:
        """Available slots per active request; an idle instance is infinitely free."""
        return self.available / self.active if self.active else math.inf


class DecodePlacer:
    """Picks decode instances by one strategy; ROUND_ROBIN's turn is its only state."""

    def __init__(self, strategy: Placement) -> None:
        self.strategy = strategy
        self._turn = 0

    def choose(self, loads: Sequence[DecodeLoad], slots: int) -> int | None:
        """The index of the instance for a request needing ``slots`` KV slots, or None."""
        fits = [i for i, load in enumerate(loads) if load.available >= slots]
        if not fits:
            return None
        if self.strategy is Placement.FREENESS:
            # Ties: more available slots, then the lower index.
            return min(fits, key=lambda i: (-loads[i].freeness, -loads[i].available, i))
        if self.strategy is Placement.LEAST_LOADED:
            return min(fits, key=lambda i: (loads[i].active, -loads[i].available, i))
        # The first instance with room at or after the turn, wrapping round.
        pick = min(fits, key=lambda i: (i - self._turn) % len(loads))
        self._turn = pick + 1
        return pick
