"""A calibration profile (issue 30, item 1): step costs of the real engine per layout, measured by
``gearshift profile --layouts`` on one device type, that ``gearshift plan --profile`` prices
candidates from instead of the roofline. Torch-free: the operator reads it from a ConfigMap.

The file is JSON, ``format: gearshift.profile/2``::

    {"format": "gearshift.profile/2",
     "device": "NVIDIA H200", "device_kind": "cuda", "devices": 2,
     "engine_version": "0.1.0", "dtype": "bfloat16", "model": "...",
     "model_shape": {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "intermediate_size": 14336,
                     "vocab_size": 128256, "head_dim": 128},
     "layouts": {"tp2": {"policy": {"static": {"tp": 2}}, "kv_blocks": 900, "block_size": 16,
                         "step_cost": {<a gearshift.step-cost/1 fit, its ``about`` holding
                                       the measured grid: GRID_KEYS>},
                         "collectives": {"all_reduce": {"ranks": 2,
                                                        "points": [[bytes, seconds], ...]}}}}}

Each layout's step cost is a whole step as the engine runs it, so its collectives are inside it;
``collectives`` records them on their own where the layout has them: timed inside the layout's
running group (worker/parallel/collective_timing.py says what ``bytes`` counts per collective) over
``ranks`` ranks, the median of repeated calls at each size. One-rank layouts have none (``{}``).
``links.py`` fits α + bytes/bandwidth to them. Anything unknown or missing is refused with the
key's path (``ProfileError``), as are numbers that are not finite and layouts needing more devices
than ``devices``.

``model_shape`` is what was measured, in config.json's names (the fields that decide a step's
cost, as the planner's ModelDesc holds them; ``head_dim`` the attention head's width, explicit or
hidden / heads): ``check_model`` refuses to price a model of another shape or dtype from it.
``gearshift.profile/1`` files, written before the shape and grid were recorded, are refused with
a word to profile again.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from gearshift.operator.sim.cost_model import FORMAT as STEP_FORMAT
from gearshift.operator.sim.cost_model import (
    CostModelError,
    LinearFit,
    StepCostModel,
    batch_features,
)
from gearshift.operator.sim.model_desc import ModelDesc

FORMAT = "gearshift.profile/2"
OLD_FORMATS = ("gearshift.profile/1",)
TOP_KEYS = (
    "format",
    "device",
    "device_kind",
    "devices",
    "engine_version",
    "dtype",
    "model",
    "model_shape",
)
# The model's shape as config.json names it: what decides a step's cost (ModelDesc's fields).
SHAPE_KEYS = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "head_dim",
)
DTYPES = ("bfloat16", "float16", "float32")  # what the engine runs in (worker/config.py)
# The largest measured steps of each fit, in ``step_cost.about`` (sim/profile.py writes them):
# tokens per step and attended (query, key) pairs per step, for prefill and decode-only steps.
GRID_KEYS = (
    "prefill_max_tokens",
    "prefill_max_attended",
    "decode_max_tokens",
    "decode_max_attended",
)
LAYOUT_KEYS = ("policy", "kv_blocks", "block_size", "step_cost", "collectives")
STEP_KEYS = ("format", "prefill", "decode", "decode_scale", "about")
COLLECTIVE_KEYS = ("ranks", "points")
# parallel/collective_timing.py's names (repeated here: the operator reads profiles without torch).
COLLECTIVES = ("all_reduce", "all_to_all", "all_gather", "send_recv")


class ProfileError(ValueError):
    """A calibration profile is malformed; the message names the key."""


def layout_of(policy: dict[str, Any], where: str = "policy") -> str | None:
    """The layout name (``one``, ``tp2``, ``sp2``, ``pp2``, ``shift2``) of a CRD policy object
    that a per-layout step cost can price, or None (SiDP, Seesaw, Tetris: several engines).
    A degree that is not a whole number >= 1 is refused naming its key under ``where``."""
    if set(policy) == {"static"}:
        body = _degrees(policy["static"], f"{where}.static")
        degrees = {k: d for k, d in body.items() if k in ("tp", "sp", "pp") and d > 1}
        if set(body) - {"tp", "sp", "pp"} or len(degrees) > 1:
            return None
        if not degrees:
            return "one"
        ((kind, d),) = degrees.items()
        return f"{kind}{d}"
    if set(policy) == {"shift"}:
        body = _degrees(policy["shift"], f"{where}.shift")
        if body.get("tp", 1) != 1 or set(body) - {"sp", "tp", "threshold"}:
            return None
        return f"shift{body.get('sp', 1)}"
    return None


def ranks_of(layout: str) -> int:
    """The devices a layout (``layout_of``'s name) runs on: its degree, 1 for ``one``."""
    return 1 if layout == "one" else int(re.sub(r"^[a-z]+", "", layout))


def _degrees(body: Any, where: str) -> dict[str, int]:
    """A policy body's degrees (tp, sp, pp) checked to be whole numbers >= 1; other keys (a
    Shift threshold) as they are."""
    body = body or {}
    if not isinstance(body, dict):
        raise ProfileError(f"{where}: expected a mapping, got {body!r}")
    for key in ("tp", "sp", "pp"):
        value = body.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ProfileError(f"{where}.{key}: expected an integer >= 1, got {value!r}")
    return body


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

    def grid(self) -> dict[str, float]:
        """The largest measured steps (GRID_KEYS), from the step cost's ``about``."""
        return {k: float(self.step_cost.about[k]) for k in GRID_KEYS}

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
    model_shape: dict[str, int]  # SHAPE_KEYS: what ``model`` is, comparable (``check_model``)
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


def shape_of(desc: ModelDesc) -> dict[str, int]:
    """A planned model's ``model_shape`` (SHAPE_KEYS), to compare with a profile's."""
    return {
        "num_hidden_layers": desc.layers,
        "hidden_size": desc.hidden,
        "num_attention_heads": desc.heads,
        "num_key_value_heads": desc.kv_heads,
        "intermediate_size": desc.ffn,
        "vocab_size": desc.vocab,
        "head_dim": desc.head_dim,
    }


def runs_in(dtype: str, device_kind: str) -> str:
    """The dtype the engine runs a checkpoint of ``dtype`` in with ``--dtype auto`` on a
    ``device_kind`` device (worker/config.py, resolve_dtype: float16 is bfloat16 on a CPU)."""
    return "bfloat16" if dtype == "float16" and device_kind == "cpu" else dtype


def differences(
    profile: CalibrationProfile, desc: ModelDesc, dtype: str | None = None
) -> list[tuple[str, Any, Any]]:
    """(key, the profile's value, the model's) for every SHAPE_KEYS field and the dtype in which
    ``profile`` did not measure ``desc``; ``dtype``: what the model runs in (default its own)."""
    mine = shape_of(desc)
    out: list[tuple[str, Any, Any]] = [
        (k, profile.model_shape[k], mine[k])
        for k in SHAPE_KEYS
        if profile.model_shape[k] != mine[k]
    ]
    wanted = dtype or desc.dtype
    if profile.dtype not in (wanted, runs_in(wanted, profile.device_kind)):
        out.append(("dtype", profile.dtype, wanted))
    return out


def check_model(
    profile: CalibrationProfile,
    desc: ModelDesc,
    where: str,
    model: str,
    name: Callable[[str], str],
    dtype: str | None = None,
) -> None:
    """ProfileError unless ``profile`` measured ``desc`` (its shape) in ``dtype`` (default the
    model's). The message, prefixed ``where``, names each field that differs on both sides: the
    profile's key, and the model's as ``name(key)`` (``key``: a SHAPE_KEYS field or ``dtype``)."""
    diffs = differences(profile, desc, dtype)
    if not diffs:
        return
    fields = "; ".join(
        f"{'' if key == 'dtype' else 'model_shape.'}{key} {theirs} vs {name(key)} {mine}"
        for key, theirs, mine in diffs
    )
    raise ProfileError(
        f"{where}: the profile measured another model ({profile.model}) than {model}: "
        f"{fields}; its step costs do not price this model: profile it (gearshift profile "
        "--layouts)"
    )


@dataclass
class GridUse:
    """The largest steps one layout's measured cost priced (``used``, GRID_KEYS), against the
    largest its profile measured (``measured``): beyond them the linear fits extrapolate."""

    layout: str
    measured: dict[str, float]
    used: dict[str, float] = field(default_factory=lambda: dict.fromkeys(GRID_KEYS, 0.0))

    def beyond(self) -> list[tuple[str, float, float]]:
        """(GRID_KEYS key, measured, used) where a priced step went past the measured ones."""
        return [
            (k, self.measured[k], self.used[k])
            for k in GRID_KEYS
            if self.used[k] > self.measured[k]
        ]


@dataclass(frozen=True)
class WatchedCost:
    """A layout's measured step cost that notes, in ``use``, the largest steps it prices."""

    cost: StepCostModel
    use: GridUse

    def step_time(self, batch: Any) -> float:
        tokens, attended = batch_features(batch)
        kind = "prefill" if batch.prefills else "decode"
        used = self.use.used
        used[f"{kind}_max_tokens"] = max(used[f"{kind}_max_tokens"], tokens)
        used[f"{kind}_max_attended"] = max(used[f"{kind}_max_attended"], attended)
        return self.cost.step_time(batch)


GRID_WORDS = {
    "prefill_max_tokens": "prefill steps of up to {} tokens",
    "prefill_max_attended": "prefill steps attending up to {} positions",
    "decode_max_tokens": "decode batches of up to {} sequences",
    "decode_max_attended": "decode steps attending up to {} positions",
}


def grid_note(uses: list[GridUse]) -> str:
    """The line saying which layouts were priced beyond their measured grid ("": none)."""
    parts = []
    for use in uses:
        beyond = use.beyond()
        if beyond:
            what = ", ".join(
                f"{GRID_WORDS[k].format(f'{m:.0f}')} measured, {u:.0f} used" for k, m, u in beyond
            )
            parts.append(f"{use.layout}: {what}")
    if not parts:
        return ""
    head = "priced beyond the profile's measured grid (its linear fits extrapolated)"
    return f"{head}: {'; '.join(parts)}"


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
    if isinstance(data, dict) and data.get("format") in OLD_FORMATS:
        raise ProfileError(
            f"{where}.format: {data['format']!r} was written before profiles recorded the "
            f"measured model's shape (model_shape) and grid; profile again with gearshift "
            f"profile --layouts (this engine reads {FORMAT!r})"
        )
    _mapping(data, where, (*TOP_KEYS, "layouts"))
    if data.get("format") != FORMAT:
        raise ProfileError(
            f"{where}.format: expected {FORMAT!r} (written by gearshift profile --layouts), "
            f"got {data.get('format')!r}"
        )
    strings = {
        k: _string(data, k, where)
        for k in TOP_KEYS
        if k not in ("format", "devices", "model_shape")
    }
    if strings["device_kind"] not in ("cpu", "cuda"):
        raise ProfileError(f"{where}.device_kind: cpu or cuda, got {strings['device_kind']!r}")
    if strings["dtype"] not in DTYPES:
        raise ProfileError(f"{where}.dtype: one of {', '.join(DTYPES)}, got {strings['dtype']!r}")
    devices = _integer(data, "devices", where)
    shape = _shape(data.get("model_shape"), f"{where}.model_shape")
    layouts_data = data.get("layouts")
    if not isinstance(layouts_data, dict) or not layouts_data:
        raise ProfileError(f"{where}.layouts: expected a non-empty mapping of layout name to cost")
    layouts = {
        str(name): _layout(body, str(name), devices, f"{where}.layouts.{name}")
        for name, body in layouts_data.items()
    }
    return CalibrationProfile(
        strings["device"],
        strings["device_kind"],
        devices,
        strings["engine_version"],
        strings["dtype"],
        strings["model"],
        shape,
        layouts,
    )


def _shape(data: Any, where: str) -> dict[str, int]:
    if data is None:
        raise ProfileError(
            f"{where}: missing: the measured model's shape ({', '.join(SHAPE_KEYS)}); profile "
            "again with gearshift profile --layouts"
        )
    _mapping(data, where, SHAPE_KEYS)
    return {k: _integer(data, k, where) for k in SHAPE_KEYS}


def _layout(body: Any, name: str, devices: int, where: str) -> LayoutProfile:
    _mapping(body, where, LAYOUT_KEYS)
    policy = body.get("policy")
    if not isinstance(policy, dict):
        raise ProfileError(f"{where}.policy: expected the CRD's policy object")
    layout = layout_of(policy, f"{where}.policy")
    if layout != name:
        raise ProfileError(f"{where}.policy: {policy} is layout {layout}, not {name}")
    if ranks_of(name) > devices:
        raise ProfileError(
            f"{where}: layout {name} runs on {ranks_of(name)} devices, more than the profile's "
            f"devices ({devices})"
        )
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
            # A least-squares fit may come out negative in a term (the step time is clamped
            # above zero where it is read); not finite, it prices nothing.
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ProfileError(f"{where}.{key}.{coef}: expected a number, got {value!r}")
            if not _finite(value):
                raise ProfileError(
                    f"{where}.{key}.{coef}: expected a finite number, got {value!r:.40}"
                )
        fits[key] = LinearFit(*(float(part.get(coef, 0.0)) for coef in ("a", "b", "c", "d")))
    scale = data.get("decode_scale", [])
    if not isinstance(scale, list) or not all(
        isinstance(p, list) and len(p) == 2 and _whole(p[0]) and _positive(p[1]) for p in scale
    ):
        raise ProfileError(
            f"{where}.decode_scale: expected [[batch size, factor], ...], whole batch sizes "
            "and finite positive factors"
        )
    about = data.get("about", {})
    if not isinstance(about, dict):
        raise ProfileError(f"{where}.about: expected a mapping")
    for key in GRID_KEYS:
        if not _positive(about.get(key)):
            raise ProfileError(
                f"{where}.about.{key}: expected a finite number > 0 (the largest measured step), "
                f"got {about.get(key)!r}"
            )
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
    if not _whole(value):
        raise ProfileError(f"{where}.{key}: expected an integer >= 1, got {value!r}")
    return value


def _whole(value: Any) -> TypeGuard[int]:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def _positive(value: Any) -> bool:
    """A finite number above zero (JSON's NaN and Infinity are not)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return _finite(value) and value > 0


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer past a float's range
        return False
