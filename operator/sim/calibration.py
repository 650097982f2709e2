"""A calibration profile (issue 30, item 1): step costs of the real engine per layout, measured by
``gearshift profile --layouts`` on one device type, that ``gearshift plan --profile`` prices
candidates from instead of the roofline. Torch-free: the operator reads it from a ConfigMap.

The file is JSON, ``format: gearshift.profile/1``::

    {"format": "gearshift.profile/1",
     "device": "NVIDIA H200", "device_kind": "cuda", "devices": 2,
     "engine_version": "0.1.0", "dtype": "bfloat16", "model": "...",
     "layouts": {"tp2": {"policy": {"static": {"tp": 2}}, "kv_blocks": 900, "block_size": 16,
                         "step_cost": {<a gearshift.step-cost/1 fit>},
                         "collectives": {"all_reduce": {"ranks": 2,
                                                        "points": [[bytes, seconds], ...]}}}}}

Each layout's step cost is a whole step as the engine runs it, so its collectives are inside it;
``collectives`` records them on their own where the layout has them: timed inside the layout's
running group (worker/parallel/collective_timing.py says what ``bytes`` counts per collective) over
``ranks`` ranks, the median of repeated calls at each size. One-rank layouts have none (``{}``).
``links.py`` fits α + bytes/bandwidth to them. Anything unknown or missing is refused with the
key's path (``ProfileError``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gearshift.operator.sim.cost_model import FORMAT as STEP_FORMAT
from gearshift.operator.sim.cost_model import CostModelError, LinearFit, StepCostModel

FORMAT = "gearshift.profile/1"
TOP_KEYS = ("format", "device", "device_kind", "devices", "engine_version", "dtype", "model")
LAYOUT_KEYS = ("policy", "kv_blocks", "block_size", "step_cost", "collectives")
STEP_KEYS = ("format", "prefill", "decode", "decode_scale", "about")
COLLECTIVE_KEYS = ("ranks", "points")
# parallel/collective_timing.py's names (repeated here: the operator reads profiles without torch).
COLLECTIVES = ("all_reduce", "all_to_all", "all_gather", "send_recv")


class ProfileError(ValueError):
    """A calibration profile is malformed; the message names the key."""


def layout_of(policy: dict[str, Any]) -> str | None:
    """The layout name (``one``, ``tp2``, ``sp2``, ``pp2``, ``shift2``) of a CRD policy object
    that a per-layout step cost can price, or None (SiDP, Seesaw, Tetris: several engines)."""
    if set(policy) == {"static"}:
        body = policy["static"] or {}
        degrees = {k: int(v) for k, v in body.items() if k in ("tp", "sp", "pp") and int(v) > 1}
        if set(body) - {"tp", "sp", "pp"} or len(degrees) > 1:
            return None
        if not degrees:
            return "one"
        ((kind, d),) = degrees.items()
        return f"{kind}{d}"
    if set(policy) == {"shift"}:
        body = policy["shift"] or {}
        if int(body.get("tp", 1)) != 1 or set(body) - {"sp", "tp", "threshold"}:
            return None
        return f"shift{int(body.get('sp', 1))}"
    return None


@dataclass(frozen=True)
class Collective:
    """One collective timed over ``ranks`` ranks: [[bytes, seconds], ...] in size order."""

    ranks: int
    points: list[list[float]]


def collectives_from(data: Any, where: str) -> dict[str, Collective]:
    """The ``collectives`` mapping of a layout, checked; ``where`` prefixes every error."""
    if not isinstance(data, dict):
        raise ProfileError(f"{where}: expected a mapping of collective to {{ranks, points}}")
    out = {}
    for name, body in data.items():
        at = f"{where}.{name}"
        if name not in COLLECTIVES:
            raise ProfileError(f"{at}: unknown collective (known: {', '.join(COLLECTIVES)})")
        _mapping(body, at, COLLECTIVE_KEYS)
        ranks = _integer(body, "ranks", at)
        if ranks < 2:
            raise ProfileError(f"{at}.ranks: a collective needs at least 2 ranks, got {ranks}")
        points = body.get("points")
        ok = isinstance(points, list) and all(
            isinstance(p, list) and len(p) == 2 and all(_positive(v) for v in p) for p in points
        )
        if not ok or not points:
            raise ProfileError(f"{at}.points: expected [[bytes, seconds], ...], each positive")
        sizes = [p[0] for p in points]
        if len(set(sizes)) < 2:
            raise ProfileError(f"{at}.points: at least two distinct sizes (α and bandwidth)")
        out[str(name)] = Collective(ranks, sorted([float(b), float(t)] for b, t in points))
    return out


@dataclass(frozen=True)
class LayoutProfile:
    """One layout's measured step cost and KV capacity (blocks of ``block_size`` tokens)."""

    policy: dict[str, Any]
    kv_blocks: int
    block_size: int
    step_cost: StepCostModel
    collectives: dict[str, Collective] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        c = self.step_cost
        return {
            "policy": self.policy,
            "kv_blocks": self.kv_blocks,
            "block_size": self.block_size,
            "step_cost": {
                "format": STEP_FORMAT,
                "prefill": asdict(c.prefill),
                "decode": asdict(c.decode),
                "decode_scale": [list(p) for p in c.decode_scale],
                "about": c.about,
            },
            "collectives": {n: asdict(c) for n, c in self.collectives.items()},
        }


@dataclass(frozen=True)
class CalibrationProfile:
    """Step costs per layout measured on ``devices`` devices named ``device`` (a CPU model or a
    GPU name; ``device_kind`` cpu or cuda) by engine ``engine_version`` in ``dtype``."""

    device: str
    device_kind: str
    devices: int
    engine_version: str
    dtype: str
    model: str
    layouts: dict[str, LayoutProfile]

    def describe(self) -> str:
        return (
            f"profile of {self.model} on {self.devices}x {self.device} ({self.device_kind}), "
            f"engine {self.engine_version}, {self.dtype}; layouts {', '.join(self.layouts)}"
        )

    def to_dict(self) -> dict[str, Any]:
        top = {k: getattr(self, k) for k in TOP_KEYS if k != "format"}
        return {
            "format": FORMAT,
            **top,
            "layouts": {n: lp.to_dict() for n, lp in self.layouts.items()},
        }

    def save(self, path: Path) -> None:
        from gearshift.operator.outputs import write_text

        write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")  # whole or not at all


def load(path: str | Path) -> CalibrationProfile:
    """Read and check a profile file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ProfileError(f"--profile {path}: cannot read: {exc}") from None
    return parse(text, str(path))


def parse(text: str, where: str = "profile") -> CalibrationProfile:
    """A profile from its JSON text; ``where`` prefixes every error."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ProfileError(f"{where}: not JSON: {exc}") from None
    return from_dict(data, where)


def from_dict(data: Any, where: str = "profile") -> CalibrationProfile:
    _mapping(data, where, (*TOP_KEYS, "layouts"))
    if data.get("format") != FORMAT:
        raise ProfileError(
            f"{where}.format: expected {FORMAT!r} (written by gearshift profile --layouts), "
            f"got {data.get('format')!r}"
        )
    strings = {k: _string(data, k, where) for k in TOP_KEYS if k not in ("format", "devices")}
    if strings["device_kind"] not in ("cpu", "cuda"):
        raise ProfileError(f"{where}.device_kind: cpu or cuda, got {strings['device_kind']!r}")
    devices = _integer(data, "devices", where)
    layouts_data = data.get("layouts")
    if not isinstance(layouts_data, dict) or not layouts_data:
        raise ProfileError(f"{where}.layouts: expected a non-empty mapping of layout name to cost")
    layouts = {
        str(name): _layout(body, f"{where}.layouts.{name}") for name, body in layouts_data.items()
    }
    for name, lp in layouts.items():
        if layout_of(lp.policy) != name:
            raise ProfileError(
                f"{where}.layouts.{name}.policy: {lp.policy} is layout {layout_of(lp.policy)}, "
                f"not {name}"
            )
    return CalibrationProfile(
        strings["device"],
        strings["device_kind"],
        devices,
        strings["engine_version"],
        strings["dtype"],
        strings["model"],
        layouts,
    )


def _layout(body: Any, where: str) -> LayoutProfile:
    _mapping(body, where, LAYOUT_KEYS)
    policy = body.get("policy")
    if not isinstance(policy, dict):
        raise ProfileError(f"{where}.policy: expected the CRD's policy object")
    collectives = collectives_from(body.get("collectives", {}), f"{where}.collectives")
    return LayoutProfile(
        policy,
        _integer(body, "kv_blocks", where),
        _integer(body, "block_size", where),
        _step_cost(body.get("step_cost"), f"{where}.step_cost"),
        collectives,
    )


def _step_cost(data: Any, where: str) -> StepCostModel:
    _mapping(data, where, STEP_KEYS)
    if data.get("format") != STEP_FORMAT:
        raise ProfileError(f"{where}.format: expected {STEP_FORMAT!r}, got {data.get('format')!r}")
    fits = {}
    for key in ("prefill", "decode"):
        part = data.get(key)
        _mapping(part, f"{where}.{key}", ("a", "b", "c", "d"))
        for coef in ("a", "b", "c", "d"):
            value = part.get(coef, 0.0)  # d (per sampled prompt row) is newer: 0 when absent
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not -float("inf") < value < float("inf")  # NaN and ±Infinity (JSON's)
            ):
                raise ProfileError(f"{where}.{key}.{coef}: expected a finite number, got {value!r}")
        fits[key] = LinearFit(*(float(part.get(coef, 0.0)) for coef in ("a", "b", "c", "d")))
    scale = data.get("decode_scale", [])
    if not isinstance(scale, list) or not all(
        isinstance(p, list) and len(p) == 2 and all(_positive(v) for v in p) for p in scale
    ):
        raise ProfileError(f"{where}.decode_scale: expected [[batch size, factor], ...]")
    about = data.get("about", {})
    if not isinstance(about, dict):
        raise ProfileError(f"{where}.about: expected a mapping")
    try:
        return StepCostModel(
            fits["prefill"], fits["decode"], about, tuple((int(b), float(f)) for b, f in scale)
        )
    except CostModelError as exc:
        raise ProfileError(f"{where}.{exc}") from None


def _mapping(data: Any, where: str, known: tuple[str, ...]) -> None:
    if not isinstance(data, dict):
        raise ProfileError(f"{where}: expected a mapping")
    extra = sorted(set(data) - set(known))
    if extra:
        raise ProfileError(f"{where}.{extra[0]}: unknown key (known: {', '.join(known)})")


def _string(data: dict[str, Any], key: str, where: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not value:
        raise ProfileError(f"{where}.{key}: expected a non-empty string, got {value!r}")
    return value


def _integer(data: dict[str, Any], key: str, where: str) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ProfileError(f"{where}.{key}: expected an integer >= 1, got {value!r}")
    return value


def _positive(value: Any) -> bool:
    return (
        not isinstance(value, bool) and isinstance(value, int | float) and 0 < value < float("inf")
    )
