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
blocks (its collectives are inside that cost); by default every other candidate (a layout it does
not cover, SiDP, Seesaw, Tetris) is EXCLUDED rather than priced from a roofline: a CPU profile has
no roofline to scale, and mixing measured with specified costs would compare unlike figures. The
report lists what was excluded. ``unprofiled="roofline"`` (``plan --unprofiled roofline``, a
profile of a GPU with a preset only) prices those from the scaled preset instead, with the links
fitted to the profile's measured collectives (links.py) in place of the preset's wherever a
collective was measured over the same link class: TP's all-reduces, Ulysses' all-to-alls, PP's
and Tetris' point-to-point sends and SiDP's fetches. Host↔device copies (Seesaw's KV swaps and
re-shards) are not measured: the preset's ``host_device`` link prices them. The report names,
for every link, where it came from (``links``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from typing import Any

from gearshift.operator.sim.calibration import (
    CalibrationProfile,
    GridUse,
    WatchedCost,
    grid_note,
    layout_of,
)
from gearshift.operator.sim.hardware import (
    GB,
    Device,
    Hardware,
    HardwareError,
    Link,
    preset_of_product,
)
from gearshift.operator.sim.hardware import preset as preset_hw
from gearshift.operator.sim.links import MeasuredLink, measured_links

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
    unprofiled: str = "exclude"  # or "roofline": what becomes of candidates the profile lacks
    roofline_priced: list[str] = field(default_factory=list)  # filled by ``apply``
    links: list[MeasuredLink] = field(default_factory=list)  # in ``hardware.measured``
    # Per profiled layout that priced a candidate: the largest steps priced, against the
    # largest measured (filled as the candidates are simulated).
    grid: dict[str, GridUse] = field(default_factory=dict)

    def apply(self, candidates: list[Any]) -> list[Any]:
        """The candidates to simulate: with a profile, the covered ones with measured costs."""
        if self.profile is None:
            return candidates
        kept = []
        for c in candidates:
            name = layout_of(c.policy) if c.kind in ("static", "shift") else None
            lp = self.profile.layouts.get(name) if name else None
            if lp is None:
                if self.unprofiled == "roofline":
                    self.roofline_priced.append(c.name)
                    kept.append(c)
                else:
                    self.excluded.append(c.name)
                continue
            config = replace(c.config, num_blocks=lp.kv_blocks, block_size=lp.block_size)
            assert name is not None  # a layout the profile has
            use = self.grid.setdefault(name, GridUse(name, lp.grid()))
            cost = WatchedCost(lp.step_cost, use)
            kept.append(
                dataclasses.replace(
                    c, cost=cost, config=config, kv_tokens=lp.kv_blocks * lp.block_size
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
            out["unprofiled"] = self.unprofiled
            out["priced_from_roofline"] = list(self.roofline_priced)
            out["beyond_measured_grid"] = {
                u.layout: {k: {"measured": m, "used": v} for k, m, v in u.beyond()}
                for u in self.grid.values()
                if u.beyond()
            }
            out["pricing_notes"] = [n for n in (self.grid_note(),) if n]
        out["links"] = self.links_json()
        return out

    def grid_note(self) -> str:
        """Which profiled layouts priced steps larger than their profile measured ("": none)."""
        return grid_note(list(self.grid.values()))

    def links_json(self) -> dict[str, Any]:
        """Which link constants priced collectives: fitted to the profile, or the preset's."""
        hw = self.hardware
        preset = {
            "intra_node": hw.intra_node,
            "inter_node": hw.inter_node,
            "host_device": hw.host_device,
            **({"bridge": hw.bridge} if hw.bridge is not None else {}),
        }
        if "preset" in hw.about and hw.about["preset"] is None:
            preset = {}  # a device without a preset (a CPU profile's): its links are placeholders
        used = self.profile is None or self.unprofiled == "roofline"
        return {
            "from_profile": [m.to_json() for m in self.links],
            "from_preset": {
                k: {"bandwidth_bytes_per_s": v.bandwidth, "latency_s": v.latency}
                for k, v in preset.items()
            },
            "used_by": (
                "roofline-priced candidates: a profile link where its collective was measured "
                "over the same link class, the preset's otherwise"
                if used
                else "no candidate: every one kept is priced from its measured steps, whose "
                "collectives are inside them"
            ),
        }

    def links_text(self) -> str:
        """``links_json`` as lines for the terminal."""
        data = self.links_json()
        lines = [f"links (used by {data['used_by']}):"]
        for m in self.links:
            lines.append(
                f"  profile: {m.collective} over {m.ranks} ranks ({m.layout}): "
                f"alpha {m.link.latency * 1e6:.1f} us, {m.link.bandwidth / GB:.3g} GB/s "
                f"({m.points} points, fit error {m.mean_rel_error:.0%})"
            )
        if not data["from_preset"]:
            lines.append("  preset: none (the profile's device has no preset)")
        for name, v in data["from_preset"].items():
            lines.append(
                f"  {'file' if 'file' in self.hardware.about else 'preset'}: {name}: "
                f"alpha {v['latency_s'] * 1e6:.1f} us, "
                f"{v['bandwidth_bytes_per_s'] / GB:.3g} GB/s"
            )
        return "\n".join(lines)


def _source(hw: Hardware) -> str:
    """What ``hw`` came from: a preset, or the user's hardware file (``hardware.from_dict``)."""
    if "file" in hw.about:
        return f"the hardware file {hw.about['file']} (device {hw.device.name})"
    return f"the {hw.device.name} preset"


def scaled_preset(hw: Hardware) -> Pricing:
    """``hw``'s preset with the fitted efficiencies applied (1.0 where none is usable)."""
    compute, memory = COMPUTE_EFFICIENCY, MEMORY_EFFICIENCY
    if compute is None or memory is None:
        return Pricing(
            hw,
            f"{_source(hw)} (datasheet roofline; no usable GPU measurement to fit "
            "efficiencies, 1.0 used)",
        )
    device = replace(
        hw.device,
        flops={k: v * compute for k, v in hw.device.flops.items()},
        memory_bandwidth=hw.device.memory_bandwidth * memory,
    )
    return Pricing(
        replace(hw, device=device),
        f"{_source(hw)} scaled by efficiencies fitted to {FITTED_FROM}: "
        f"compute {compute:g}, memory {memory:g}",
    )


def choose(
    hw: Hardware | None,
    profile: CalibrationProfile | None,
    given: str | None = None,
    unprofiled: str = "exclude",
) -> Pricing:
    """The one rule of ``gearshift plan`` and ``policy: auto``: the profile when there is one
    (``hw``, from ``given``, must then be its device; ``unprofiled`` as ``from_profile``), else
    ``hw``'s scaled preset; a hardware file's figures as given, unless it says ``efficiencies:
    fitted``."""
    if profile is not None:
        return from_profile(profile, hw, given, unprofiled)
    if hw is None:
        raise HardwareError("--hardware: required without --profile")
    if hw.about.get("efficiencies") == "none":  # a hardware file's figures, as given
        return Pricing(
            hw,
            f"{_source(hw)}, its figures as given: not scaled by the efficiencies fitted to "
            f"{FITTED_FROM}, which plan applies to presets only (efficiencies: fitted in the file "
            "applies them)",
        )
    return scaled_preset(hw)


def from_profile(
    profile: CalibrationProfile,
    hw: Hardware | None,
    given: str | None,
    unprofiled: str = "exclude",
) -> Pricing:
    """Pricing by ``profile``; ``hw`` (from ``--hardware`` ``given``) must be the same device.
    ``unprofiled``: ``exclude`` the candidates the profile lacks, or price them by the scaled
    preset's ``roofline`` with the profile's measured links (module docstring)."""
    if unprofiled not in ("exclude", "roofline"):
        raise HardwareError(f"--unprofiled: exclude or roofline, got {unprofiled!r}")
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
        base = Hardware(dev, profile.devices, profile.devices, link, link, link, {"preset": None})
    fitted = measured_links(profile)
    base = replace(base, measured=tuple((m.collective, m.ranks, m.link) for m in fitted))
    describe = f"the {profile.describe()}"  # "the profile of M on ..."
    if unprofiled == "roofline":
        if preset is None:
            raise HardwareError(
                f"--unprofiled roofline: the profile was measured on {profile.device} "
                f"({profile.device_kind}), which has no preset to price a roofline from"
            )
        scaled = choose(base, None)  # a hardware file's figures as given, as without a profile
        base = scaled.hardware
        describe += f"; candidates it lacks: {scaled.describe}, with its measured links"
    return Pricing(base, describe, profile, unprofiled=unprofiled, links=fitted)
