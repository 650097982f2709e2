"""Specified hardware for the roofline cost model (issue 16, item 1b): devices, how many, and the
links between them, from a built-in preset (``8xH200``) or a YAML/JSON file.

Figures are per direction: an NVLink "900 GB/s" on a datasheet is the sum of both directions, so a
ring all-reduce (which sends one way per hop) sees 450 GB/s.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

GB = 1e9
TFLOPS = 1e12
US = 1e-6


class HardwareError(ValueError):
    """A hardware description is invalid; the message names the field."""


@dataclass(frozen=True)
class Link:
    """One link class: bytes/s one way, and the fixed cost of one message."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Device:
    """One accelerator: dense FLOP/s per dtype, memory bytes and bytes/s."""

    name: str
    flops: dict[str, float]
    memory_bytes: float
    memory_bandwidth: float

    def peak(self, dtype: str) -> float:
        if dtype not in self.flops:
            raise HardwareError(f"device {self.name} has no FLOP/s for dtype {dtype!r}")
        return self.flops[dtype]


@dataclass(frozen=True)
class Hardware:
    """``count`` devices, ``devices_per_node`` to a node; intra-node links within a node."""

    device: Device
    count: int
    devices_per_node: int
    intra_node: Link
    inter_node: Link
    host_device: Link
    about: dict[str, Any] = field(default_factory=dict)
    bridge: Link | None = None  # joins groups of up to bridge_size (NVLink bridges on PCIe)
    bridge_size: int = 1
    # Links fitted to a profile's measured collectives (links.py): (collective, ranks, link).
    measured: tuple[tuple[str, int, Link], ...] = ()

    def link(self, group_size: int) -> Link:
        """The slowest link a group of ``group_size`` consecutive ranks crosses."""
        if self.bridge is not None and group_size <= self.bridge_size:
            return self.bridge
        return self.intra_node if group_size <= self.devices_per_node else self.inter_node

    def link_for(self, collective: str, group_size: int, preset: Link | None = None) -> Link:
        """The link pricing ``collective`` over ``group_size`` ranks: a measured one where this
        collective was measured on a group crossing the same link class (``link``) as this
        group, the nearest group size first; else the preset's (``preset`` or ``link``)."""
        base = self.link(group_size) if preset is None else preset
        best: tuple[int, Link] | None = None
        for name, ranks, fitted in self.measured:
            if name != collective or self.link(ranks) != base:
                continue
            if best is None or abs(ranks - group_size) < best[0]:
                best = (abs(ranks - group_size), fitted)
        return base if best is None else best[1]


# Datasheet figures (dense, no sparsity). H100/H200: NVIDIA H100 and H200 Tensor Core GPU
# datasheets, SXM form factor (BF16 989 TFLOPS, FP8 1979 TFLOPS; HBM3 80 GB at 3.35 TB/s, HBM3e
# 141 GB at 4.8 TB/s; NVLink 900 GB/s both ways; PCIe Gen5 128 GB/s both ways). L4: NVIDIA L4
# datasheet (BF16 121 TFLOPS, FP8 242 TFLOPS dense, i.e. half the "with sparsity" figures; GDDR6
# 24 GB at 300 GB/s; PCIe Gen4 x16 64 GB/s both ways; no NVLink, so peers talk over PCIe).
# Inter-node: one 400 Gb/s NDR InfiniBand NIC per GPU (DGX H100/H200 system guide) = 50 GB/s.
#
# Latencies (α, per message) are not datasheet figures, and none is measured on a machine of
# ours. A profile's measured collectives replace them where it has them (``Hardware.measured``,
# links.py; ``gearshift plan`` says which link came from where). They decide TP 8 against
# TP 4 x 2 for small steps. Each constant's source:
# - NVLink α 3 µs: NCCL's own cost model puts one ring hop of its Simple protocol (the one large
#   messages use) on NVLink at 3.4 µs (``hwLat`` in NCCL's src/graph/tuning.cc, the table NCCL
#   picks its algorithms by; its figures move between NCCL versions), rounded down.
# - PCIe α 5 µs: the same table's ring hop over PCI, 5.7 µs (unchanged across the versions
#   read: 2.x tuning.cc's early tables and today's), rounded down as NVLink's.
# - network α 10 µs: the same table's ring hop over the network, 9.6 µs in NCCL's earlier
#   tables and 14 µs in today's (NCCL has raised it as it added protocols); taken at the
#   earlier, rounded. A profile's measured collectives replace it where a group crosses nodes.
# - bridge α 3 µs: NCCL types an NVLink bridge's path as NVLink (it is NVLink between two or
#   four cards, without a switch), so the same 3.4 µs, rounded down.
_NVLINK = Link(bandwidth=450 * GB, latency=3 * US)  # H100/H200 SXM datasheets: 900 GB/s both ways
_PCIE5 = Link(bandwidth=64 * GB, latency=5 * US)  # PCIe Gen5 x16: 128 GB/s both ways (datasheets)
_PCIE4 = Link(bandwidth=32 * GB, latency=5 * US)  # PCIe Gen4 x16: 64 GB/s both ways (L4 datasheet)
# One 400 Gb/s NDR InfiniBand NIC per GPU (NVIDIA DGX H100/H200 user guide: eight ConnectX-7
# for eight GPUs) = 50 GB/s one way. The PCIe and NVL presets take the same NIC per GPU: their
# servers vary (a configuration, not a part's figure); a hardware file sets it.
_IB_NDR = Link(bandwidth=50 * GB, latency=10 * US)
# NVLink bridges of the PCIe cards (H100 PCIe, H100 NVL: a 2-GPU bridge, 600 GB/s both ways;
# H200 NVL: a 2- or 4-GPU bridge, 900 GB/s both ways; their datasheets). A group larger than a
# bridge talks over PCIe Gen5.
_BRIDGE_H100 = Link(bandwidth=300 * GB, latency=3 * US)
_BRIDGE_H200 = Link(bandwidth=450 * GB, latency=3 * US)
# L4 servers' network: unsourced: 200 Gb/s (25 GB/s) is a common NIC of PCIe inference servers,
# not a figure of an L4 document (the card has no network of its own).
_NET_200G = Link(bandwidth=25 * GB, latency=10 * US)
# devices_per_node 8: NVIDIA DGX/HGX H100 and H200 systems hold eight GPUs; PCIe cards and L4:
# unsourced: eight is a common PCIe server (vendor-specific; a hardware file sets it).


@dataclass(frozen=True)
class Preset:
    """A device and its links: ``bridge`` joins groups of up to ``bridge_size`` within a node
    (NVLink bridges on PCIe cards); above that a group talks over ``intra``."""

    device: Device
    devices_per_node: int
    intra: Link
    inter: Link
    host: Link
    bridge: Link | None = None
    bridge_size: int = 1


def _flops(bf16_tflops: float, fp8_tflops: float) -> dict[str, float]:
    return {"bf16": bf16_tflops * TFLOPS, "fp16": bf16_tflops * TFLOPS, "fp8": fp8_tflops * TFLOPS}


PRESETS: dict[str, Preset] = {
    "H200": Preset(
        Device("H200", _flops(989, 1979), 141 * GB, 4800 * GB), 8, _NVLINK, _IB_NDR, _PCIE5
    ),
    "H100": Preset(
        Device("H100", _flops(989, 1979), 80 * GB, 3350 * GB), 8, _NVLINK, _IB_NDR, _PCIE5
    ),
    # NVIDIA H100 datasheet, PCIe column: BF16 1,513 / FP8 3,026 TFLOPS with sparsity (half
    # dense), HBM2e 80 GB at 2.0 TB/s, PCIe Gen5 128 GB/s, NVLink bridge 600 GB/s per pair.
    "H100PCIE": Preset(
        Device("H100PCIE", _flops(756, 1513), 80 * GB, 2000 * GB), 8, _PCIE5, _IB_NDR, _PCIE5,
        _BRIDGE_H100, 2,
    ),
    # NVIDIA H100 datasheet, NVL column: BF16 1,671 / FP8 3,341 TFLOPS with sparsity, HBM3
    # 94 GB at 3.9 TB/s, PCIe Gen5 128 GB/s, NVLink bridge 600 GB/s per pair.
    "H100NVL": Preset(
        Device("H100NVL", _flops(835.5, 1670.5), 94 * GB, 3900 * GB), 8, _PCIE5, _IB_NDR, _PCIE5,
        _BRIDGE_H100, 2,
    ),
    # NVIDIA H200 datasheet, NVL column: BF16 1,671 / FP8 3,341 TFLOPS with sparsity, HBM3e
    # 141 GB at 4.8 TB/s, PCIe Gen5 128 GB/s, 2- or 4-way NVLink bridge 900 GB/s (taken: 4-way).
    "H200NVL": Preset(
        Device("H200NVL", _flops(835.5, 1670.5), 141 * GB, 4800 * GB), 8, _PCIE5, _IB_NDR, _PCIE5,
        _BRIDGE_H200, 4,
    ),
    "L4": Preset(
        Device("L4", _flops(121, 242), 24 * GB, 300 * GB), 8, _PCIE4, _NET_200G, _PCIE4,
    ),
}  # fmt: skip


def preset_of_product(product: str) -> str | None:
    """The preset for a node's ``nvidia.com/gpu.product`` label (the driver's name, spaces as
    dashes: "NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-PCIe", "NVIDIA-H100-NVL", "NVIDIA-H200-NVL"),
    or None. Whole words only, so an L40S is not taken for an L4, and a PCIe or NVL card is not
    taken for its SXM sibling."""
    words = set(product.upper().replace("_", "-").replace(" ", "-").split("-"))
    found = [w for w in words if w in PRESETS]
    if len(found) != 1:
        return None
    name = found[0]
    forms = words & {"PCIE", "NVL"}
    variants = {f for f in ("PCIE", "NVL") if name + f in PRESETS}
    if not forms or not variants:
        return name  # an SXM part, or a card made in one form only (L4)
    match = [name + f for f in forms if f in variants]
    return match[0] if len(match) == 1 else None


_SPEC = re.compile(r"^(?:(\d+)x)?([A-Za-z0-9]+)$")


def preset(spec: str) -> Hardware:
    """``8xH200``, ``H100`` (one device) or ``2xL4``."""
    m = _SPEC.match(spec.strip())
    if not m or m.group(2).upper() not in PRESETS:
        known = ", ".join(sorted(PRESETS))
        raise HardwareError(f"--hardware {spec!r}: expected NxNAME with NAME one of {known}")
    count = int(m.group(1) or 1)
    if count < 1:
        raise HardwareError(f"--hardware {spec!r}: the device count must be at least 1")
    p = PRESETS[m.group(2).upper()]
    return Hardware(
        p.device, count, min(p.devices_per_node, count), p.intra, p.inter, p.host,
        {"preset": spec}, p.bridge, p.bridge_size,
    )  # fmt: skip


def _number(data: dict[str, Any], key: str, where: str) -> float:
    value = data.get(key)
    if isinstance(value, str):
        # PyYAML (YAML 1.1) reads "1.0e14" (no exponent sign) as a string.
        with contextlib.suppress(ValueError):
            value = float(value)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not value > 0
        or not math.isfinite(value)
    ):
        raise HardwareError(f"{where}.{key}: expected a finite positive number, got {value!r}")
    return float(value)


def _link(data: Any, where: str) -> Link:
    if not isinstance(data, dict):
        raise HardwareError(f"{where}: expected a mapping with bandwidth and latency")
    latency = data.get("latency", 0.0)
    if isinstance(latency, str):
        with contextlib.suppress(ValueError):  # "3.0e-6" (YAML 1.1), as _number
            latency = float(latency)
    if (
        isinstance(latency, bool)
        or not isinstance(latency, int | float)
        or not latency >= 0
        or not math.isfinite(latency)
    ):
        raise HardwareError(f"{where}.latency: expected finite seconds >= 0, got {latency!r}")
    return Link(_number(data, "bandwidth", where), float(latency))


def from_dict(data: Any, where: str = "hardware") -> Hardware:
    """The file format (docs/planning.md): bytes, bytes/s, FLOP/s and seconds, SI units."""
    if not isinstance(data, dict):
        raise HardwareError(f"{where}: expected a mapping")
    known = {
        "device", "count", "devices_per_node", "intra_node", "inter_node", "host_device",
        "efficiencies",
    }  # fmt: skip
    extra = sorted(set(data) - known)
    if extra:
        raise HardwareError(f"{where}: unknown field(s) {', '.join(extra)}")
    dev = data.get("device")
    if not isinstance(dev, dict):
        raise HardwareError(f"{where}.device: expected a mapping")
    flops = dev.get("flops")
    if not isinstance(flops, dict) or not flops:
        raise HardwareError(f"{where}.device.flops: expected a mapping of dtype to FLOP/s")
    device = Device(
        str(dev.get("name", "custom")),
        {str(k): _number(flops, k, f"{where}.device.flops") for k in flops},
        _number(dev, "memory_bytes", f"{where}.device"),
        _number(dev, "memory_bandwidth", f"{where}.device"),
    )
    count = data.get("count", 1)
    per_node = data.get("devices_per_node", count)
    for key, value in (("count", count), ("devices_per_node", per_node)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise HardwareError(f"{where}.{key}: expected an integer >= 1, got {value!r}")
    intra = _link(data.get("intra_node"), f"{where}.intra_node")
    inter = _link(data.get("inter_node", data.get("intra_node")), f"{where}.inter_node")
    host = _link(data.get("host_device", data.get("intra_node")), f"{where}.host_device")
    # Whether plan scales the figures by the efficiencies fitted to our H200 measurement, as it
    # does a preset's (pricing.py): a file's are taken as given unless it asks.
    efficiencies = data.get("efficiencies", "none")
    if efficiencies not in ("none", "fitted"):
        raise HardwareError(f"{where}.efficiencies: none or fitted, got {efficiencies!r}")
    about = {"file": where, "efficiencies": efficiencies}
    return Hardware(device, count, min(per_node, count), intra, inter, host, about)


def load(spec: str) -> Hardware:
    """A preset spec, or a path to a .yaml/.yml/.json file."""
    path = Path(spec)
    if path.suffix.lower() in (".yaml", ".yml", ".json"):
        try:
            text = path.read_text(encoding="utf-8")
            data = json.loads(text) if path.suffix.lower() == ".json" else yaml.safe_load(text)
        except (OSError, ValueError, yaml.YAMLError) as exc:
            raise HardwareError(f"--hardware {spec}: cannot read: {exc}") from None
        return from_dict(data, str(path))
    return preset(spec)


def with_count(hw: Hardware, count: int) -> Hardware:
    """The same machine with ``count`` devices (a layout using fewer than all of them)."""
    return replace(hw, count=count, devices_per_node=min(hw.devices_per_node, count))
