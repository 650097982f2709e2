"""What every reproduction shares: the result type and the one set of cost-model constants.

The constants are the simulator's own defaults (``candidates.PlanSettings``: vLLM's 0.9 memory
utilisation, 8192 batched tokens, 256 sequences, 16-token blocks) and the hardware presets'
datasheet figures. No reproduction sets a constant of its own; where a paper's hardware is not
a preset, its module builds it from the paper's published figures and says where they come from.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gearshift.operator.sim.candidates import PlanSettings
from gearshift.operator.sim.hardware import Hardware
from gearshift.operator.sim.pricing import scaled_preset

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


@dataclass(frozen=True)
class Projection:
    """One of issue 29's comparisons projected on a paper's hardware (issue 29, Measure): the
    simulator's ratio of the technique over its baseline, priced one way, beside the paper's."""

    paper: str
    comparison: str  # technique vs baseline, and the workload
    hardware: str  # the paper's hardware, as modelled
    pricing: str  # "scaled" (the preset times the fitted efficiencies) or "datasheet"
    metric: str  # what ``simulated`` is, e.g. "x tokens/s, SiDP AUTO / plain DP"
    simulated: float
    paper_figure: str  # as published, with its section / figure
    band: tuple[float, float]  # where tests/sim/test_projections.py pins ``simulated``
    figures: dict[str, Any]  # each side's figures (tokens/s, TPOT, TTFT, transitions, ...)
    note: str  # the setup, and where and why the projection differs from the paper

    @property
    def within(self) -> bool:
        return self.band[0] <= self.simulated <= self.band[1]


def priced(hw: Hardware, pricing: str) -> Hardware:
    """``hw`` as ``pricing`` prices it: "datasheet" as given, "scaled" by the efficiencies
    fitted to the recorded GPU run (``pricing.scaled_preset``)."""
    if pricing == "datasheet":
        return hw
    if pricing == "scaled":
        return scaled_preset(hw).hardware
    raise ValueError(f"pricing must be 'scaled' or 'datasheet', got {pricing!r}")


PRICINGS = ("scaled", "datasheet")
