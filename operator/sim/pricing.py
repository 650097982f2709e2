"""What prices a plan's steps (issue 30, item 1): a measured calibration profile
(``calibration.py``), or a hardware preset's roofline scaled by efficiencies fitted to the latest
recorded GPU measurement.

The fitted efficiencies come from the one GPU recording we have, an H200 running a random 8-layer
Llama (hidden 2048, bf16) offline and at 8 req/s (``benchmarks/sim_fidelity_h200.json`` and
``sim_fidelity_h200_online.json``), each of which priced the same trace from the H200 preset too:

- compute (prefill-bound): the roofline's mean TTFT over the measured one, 0.0439 and 0.0168,
  geometric mean 0.0272: the device's FLOP/s are scaled by it;
- memory (decode-bound): the roofline's mean TPOT over the measured one, 0.0335 and 0.0256,
  geometric mean 0.0293: its memory bandwidth is scaled by it.

Links are left as specified: the recording ran one rank, so no collective was measured. The
figures are a small model's (launch overheads dominate), so they over-price large models' steps;
a profile of the target (``gearshift profile --layouts``) replaces them. ``tests/sim/
test_pricing.py`` re-derives both from the JSON files.

With a profile, a static or Shift layout the profile covers takes its measured step cost and KV
blocks; every other candidate (a layout it does not cover, SiDP, Seesaw, Tetris) is EXCLUDED
rather than priced from a roofline: a CPU profile has no roofline to scale, and mixing measured
with specified costs would compare unlike figures. The report lists what was excluded.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from typing import Any

from gearshift.operator.sim.calibration import CalibrationProfile, layout_of
from gearshift.operator.sim.hardware import (
    GB,
    Device,
    Hardware,
    HardwareError,
    Link,
    preset_of_product,
)
from gearshift.operator.sim.hardware import preset as preset_hw

# The fitted efficiencies (module docstring); None would mean "not usable" (then 1.0, said so).
COMPUTE_EFFICIENCY: float | None = 0.0272
MEMORY_EFFICIENCY: float | None = 0.0293
FITTED_FROM = "benchmarks/sim_fidelity_h200.json, sim_fidelity_h200_online.json (NVIDIA H200)"


@dataclass(frozen=True)
class Pricing:
    """The hardware the candidates are enumerated on, what prices them (``describe``), and the
    profile that replaces their step costs (None: the scaled preset)."""

    hardware: Hardware
    describe: str
    profile: CalibrationProfile | None = None
    excluded: list[str] = field(default_factory=list)  # filled by ``apply``

    def apply(self, candidates: list[Any]) -> list[Any]:
        """The candidates to simulate: with a profile, the covered ones with measured costs."""
        if self.profile is None:
            return candidates
        kept = []
        for c in candidates:
            name = layout_of(c.policy) if c.kind in ("static", "shift") else None
            lp = self.profile.layouts.get(name) if name else None
            if lp is None:
                self.excluded.append(c.name)
                continue
            config = replace(c.config, num_blocks=lp.kv_blocks, block_size=lp.block_size)
            kept.append(
                dataclasses.replace(
                    c, cost=lp.step_cost, config=config, kv_tokens=lp.kv_blocks * lp.block_size
                )
            )
        return kept

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"pricing": self.describe}
        if self.profile is not None:
            out["profile"] = {
                "device": self.profile.device,
                "devices": self.profile.devices,
                "engine_version": self.profile.engine_version,
                "dtype": self.profile.dtype,
                "model": self.profile.model,
                "layouts": list(self.profile.layouts),
            }
            out["excluded_not_in_profile"] = list(self.excluded)
        return out


def scaled_preset(hw: Hardware) -> Pricing:
    """``hw``'s preset with the fitted efficiencies applied (1.0 where none is usable)."""
    compute, memory = COMPUTE_EFFICIENCY, MEMORY_EFFICIENCY
    if compute is None or memory is None:
        return Pricing(
            hw,
            f"the {hw.device.name} preset (datasheet roofline; no usable GPU measurement to fit "
            "efficiencies, 1.0 used)",
        )
    device = replace(
        hw.device,
        flops={k: v * compute for k, v in hw.device.flops.items()},
        memory_bandwidth=hw.device.memory_bandwidth * memory,
    )
    return Pricing(
        replace(hw, device=device),
        f"the {hw.device.name} preset scaled by efficiencies fitted to {FITTED_FROM}: "
        f"compute {compute:g}, memory {memory:g}",
    )


def choose(
    hw: Hardware | None, profile: CalibrationProfile | None, given: str | None = None
) -> Pricing:
    """The one rule of ``gearshift plan`` and ``policy: auto``: the profile when there is one
    (``hw``, from ``given``, must then be its device), else ``hw``'s scaled preset."""
    if profile is not None:
        return from_profile(profile, hw, given)
    if hw is None:
        raise HardwareError("--hardware: required without --profile")
    return scaled_preset(hw)


def from_profile(profile: CalibrationProfile, hw: Hardware | None, given: str | None) -> Pricing:
    """Pricing by ``profile``; ``hw`` (from ``--hardware`` ``given``) must be the same device."""
    preset = preset_of_product(profile.device) if profile.device_kind == "cuda" else None
    if hw is not None:
        if preset is None or hw.device.name.upper() != preset:
            raise HardwareError(
                f"--hardware {given}: the profile was measured on {profile.device} "
                f"({profile.device_kind}), not on {hw.device.name}; leave --hardware out or "
                "give the same device"
            )
        base = hw
    elif preset is not None:
        base = preset_hw(f"{profile.devices}x{preset}")
    else:
        # A device with no preset (a CPU): enumeration needs only the count here, since every
        # kept candidate takes its KV capacity from the profile; the memory is not a limit.
        dev = Device(profile.device, {profile.dtype: 1.0}, 1e6 * GB, 1.0)
        link = Link(1.0, 0.0)
        base = Hardware(dev, profile.devices, profile.devices, link, link, link, {})
    return Pricing(base, f"the profile {profile.describe()}", profile)
