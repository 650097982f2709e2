"""What every reproduction shares: the result type and the one set of cost-model constants.

The constants are the simulator's own defaults (``candidates.PlanSettings``: vLLM's 0.9 memory
utilisation, 8192 batched tokens, 256 sequences, 16-token blocks) and the hardware presets'
datasheet figures. No reproduction sets a constant of its own; where a paper's hardware is not
a preset, its module builds it from the paper's published figures and says where they come from.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gearshift.operator.sim.candidates import PlanSettings

SETTINGS = PlanSettings()
FIXTURES = Path(__file__).resolve().parents[3] / "tests" / "sim" / "fixtures"


@dataclass(frozen=True)
class Reproduction:
    paper: str
    headline: str  # what the paper claims, in its words
    paper_figure: str  # the number(s) as published
    simulated: float | None  # our figure, same unit as the band; None: not reproduced
    band: tuple[float, float]  # where the test pins ``simulated``
    unit: str
    note: str  # the setup, and why it misses where it does

    @property
    def within(self) -> bool:
        return self.simulated is not None and self.band[0] <= self.simulated <= self.band[1]
