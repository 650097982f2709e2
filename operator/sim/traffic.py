"""Declared traffic for planning (issue 16, items 2-3): a request rate with burstiness and the
prompt / output length distributions, from flags, a YAML/JSON file or a CRD-style mapping::

    {rate: 4, burstiness: 2, prompt: {preset: sharegpt}, output: {fixed: 256},
     requests: 400, seed: 0}

A length is one of ``{preset: sharegpt | arxiv | tetris-short | tetris-medium | tetris-long}``
(an omitted output length takes the prompt preset's, else ShareGPT's answers),
``{fixed: N}``, ``{uniform: [low, high]}`` or ``{lognormal: {median, p90, low, high}}``. Every
field is checked and refused naming its path (``traffic.prompt.uniform``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from gearshift.operator.sim import lengths
from gearshift.operator.sim.arrivals import Arrivals, RateCurve
from gearshift.operator.sim.lengths import Fixed, Lengths, LogNormal, Uniform
from gearshift.operator.sim.trace import TraceError, TraceRequest
from gearshift.operator.sim.workload import synthesize

PRESETS = ("sharegpt", "arxiv", "tetris-short", "tetris-medium", "tetris-long")
FIELDS = ("rate", "burstiness", "prompt", "output", "requests", "seed")


class TrafficError(ValueError):
    """A traffic description is invalid; the message names the field."""


@dataclass(frozen=True)
class Traffic:
    rate: float  # requests per second
    prompt: Lengths
    output: Lengths
    burstiness: float = 1.0  # coefficient of variation of the gaps (1: Poisson)
    requests: int = 300  # requests per simulated rate point
    seed: int = 0
    about: str = ""  # how it was given, for reports

    def trace(self, rate: float | None = None) -> list[TraceRequest]:
        """The seeded trace at the declared rate, or at ``rate`` (same lengths, same seed)."""
        arrivals = Arrivals(RateCurve.constant(rate or self.rate), self.burstiness)
        return synthesize(self.requests, arrivals, self.prompt, self.output, self.seed)

    def at(self, rate: float) -> Traffic:
        return replace(self, rate=rate)

    @staticmethod
    def from_mapping(data: Any, where: str = "traffic") -> Traffic:
        if not isinstance(data, dict):
            raise TrafficError(f"{where}: must be a mapping with {', '.join(FIELDS)}")
        unknown = sorted(set(data) - set(FIELDS))
        if unknown:
            raise TrafficError(f"{where}.{unknown[0]}: unknown field (known: {', '.join(FIELDS)})")
        if "rate" not in data:
            raise TrafficError(f"{where}.rate: required (requests per second)")
        rate = _number(data["rate"], f"{where}.rate")
        cv = _number(data.get("burstiness", 1.0), f"{where}.burstiness")
        requests = _integer(data.get("requests", 300), f"{where}.requests", 1)
        seed = _integer(data.get("seed", 0), f"{where}.seed", 0)
        preset = data.get("prompt", {"preset": "sharegpt"})
        prompt = _lengths(preset, f"{where}.prompt", prompt_side=True)
        # Without an output length: the prompt preset's own, else ShareGPT's answers.
        default = preset if isinstance(preset, dict) and "preset" in preset else None
        output = _lengths(
            data.get("output", default or {"preset": "sharegpt"}), f"{where}.output", False
        )
        return Traffic(rate, prompt, output, cv, requests, seed, json.dumps(data, sort_keys=True))

    @staticmethod
    def load(path: str | Path) -> Traffic:
        try:
            text = Path(path).read_text(encoding="utf-8")
            data = yaml.safe_load(text)
        except (OSError, yaml.YAMLError) as exc:
            raise TrafficError(f"traffic file {path}: {exc}") from exc
        return Traffic.from_mapping(data)


def _number(value: Any, where: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not value > 0
        or not math.isfinite(value)
    ):
        raise TrafficError(f"{where}: must be a finite number > 0, got {value!r}")
    return float(value)


def _integer(value: Any, where: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise TrafficError(f"{where}: must be an integer >= {least}, got {value!r}")
    return value


def _lengths(spec: Any, where: str, prompt_side: bool) -> Lengths:
    if not isinstance(spec, dict) or len(spec) != 1:
        raise TrafficError(f"{where}: one of preset, fixed, uniform, lognormal")
    ((kind, value),) = spec.items()
    try:
        if kind == "preset":
            if value not in PRESETS:
                raise TrafficError(f"{where}.preset: {value!r} is not one of {', '.join(PRESETS)}")
            if value.startswith("tetris-"):
                # The Tetris paper gives no output lengths (§7.1): a short answer, as its TTFT
                # study measures.
                return lengths.tetris(value[7:]) if prompt_side else Fixed(128)
            pair = lengths.sharegpt() if value == "sharegpt" else lengths.arxiv_summarization()
            return pair[0] if prompt_side else pair[1]
        if kind == "fixed":
            return Fixed(_integer(value, f"{where}.fixed", 1))
        if kind == "uniform":
            if not isinstance(value, list) or len(value) != 2:
                raise TrafficError(f"{where}.uniform: [low, high], got {value!r}")
            return Uniform(
                _integer(value[0], f"{where}.uniform", 1), _integer(value[1], f"{where}.uniform", 1)
            )
        if kind == "lognormal":
            if not isinstance(value, dict) or set(value) - {"median", "p90", "low", "high"}:
                raise TrafficError(f"{where}.lognormal: {{median, p90, low, high}}, got {value!r}")
            median = _number(value.get("median"), f"{where}.lognormal.median")
            p90 = _number(value.get("p90"), f"{where}.lognormal.p90")
            low = _integer(value.get("low", 1), f"{where}.lognormal.low", 1)
            high = _integer(value.get("high", 1 << 17), f"{where}.lognormal.high", 2)
            if p90 <= median:
                raise TrafficError(f"{where}.lognormal.p90: must exceed the median")
            return LogNormal.from_median_p90(median, p90, low, high)
    except TraceError as exc:
        raise TrafficError(f"{where}.{kind}: {exc}") from exc
    raise TrafficError(f"{where}.{kind}: unknown length kind (preset, fixed, uniform, lognormal)")
