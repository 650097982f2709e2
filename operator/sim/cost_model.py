"""Step time from a fitted linear model: a + b·tokens + c·attended, one fit for steps that hold a
prefill chunk and one for decode-only steps (issue 16, item 1a: the measured cost model).

``attended`` counts (query token, key position) pairs of the step's attention: a chunk of n tokens
after c computed ones attends n·(c + (n + 1)/2) positions; a decode token attends its context.
So one feature covers both the quadratic prefill term and the KV reads of decodes.

A decode step's cost is not always linear in its batch: on a CPU, fp32 MKL reads the whole weight
once per row at 2–3 rows, so 2 sequences can cost more than 4; on a GPU, small batches cost about
the same until the matmuls become compute-bound. ``decode_scale`` corrects the decode fit per
batch size, by the ratio of measured to fitted seconds at each profiled batch size, linearly
interpolated between them (and held at the ends).

A prefill step also pays per prompt whose last chunk it runs: that prompt samples a token, so
the LM head and the sampler run over one more row (``LinearFit.d``; a small vocabulary-heavy model
on a CPU: about 0.6 ms a row). A profile fits it only when asked (``Profile.model(per_row=True)``).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from gearshift.worker.engine.scheduler import ScheduledBatch

FORMAT = "gearshift.step-cost/1"


class StepCost(Protocol):
    """What the simulator asks of a cost model: the seconds one scheduled step takes.
    Implemented by the measured ``StepCostModel`` and the specified ``roofline.RooflineCost``."""

    def step_time(self, batch: ScheduledBatch) -> float: ...


class CostModelError(ValueError):
    """A cost model file or fit is invalid; the message names what."""


def batch_features(batch: ScheduledBatch) -> tuple[int, float]:
    """(tokens, attended) of a batch as scheduled, before its sequences advance."""
    tokens, attended, _ = chunk_features(batch)
    return tokens + len(batch.decodes), attended + decode_attended(batch)


def chunk_features(batch: ScheduledBatch) -> tuple[int, float, int]:
    """(tokens, attended, rows) of the batch's prefill chunks alone, before they advance;
    ``rows``: the chunks that end their prompt (each samples a token, as LLMEngine._finish)."""
    tokens, attended, rows = 0, 0.0, 0
    for seq, n in batch.prefills:
        tokens += n
        attended += n * (seq.num_computed_tokens + (n + 1) / 2)
        rows += seq.num_computed_tokens + n == seq.num_tokens
    return tokens, attended, rows


def decode_attended(batch: ScheduledBatch) -> float:
    """Positions the batch's decode rows attend (each its context)."""
    return sum(float(s.num_computed_tokens + 1) for s in batch.decodes)


@dataclass(frozen=True)
class LinearFit:
    """seconds = a + b·tokens + c·attended + d·rows, ``rows`` the prompts whose last chunk the
    step runs (each samples a token: the LM head and the sampler over one more row)."""

    a: float
    b: float
    c: float
    d: float = 0.0

    def seconds(self, tokens: float, attended: float, rows: float = 0.0) -> float:
        return self.a + self.b * tokens + self.c * attended + self.d * rows


def fit(
    samples: Sequence[tuple[float, float, float]], rows: Sequence[float] | None = None
) -> LinearFit:
    """Least squares over (tokens, attended, seconds) samples; with ``rows`` (one per sample),
    a per-row term too, unless every sample has the same count (then it cannot be told from
    the intercept, and ``d`` is 0)."""
    if len(samples) < 3:
        raise CostModelError(f"a fit needs at least 3 samples, got {len(samples)}")
    if rows is not None and len(rows) != len(samples):
        raise CostModelError(f"{len(rows)} row counts for {len(samples)} samples")
    per_row = rows is not None and len(set(rows)) > 1 and len(samples) >= 4
    x = np.array(
        [
            [1.0, t, a, *([r] if per_row else [])]
            for (t, a, _), r in zip(samples, rows or [0.0] * len(samples), strict=True)
        ]
    )
    y = np.array([s for _, _, s in samples])
    # Scale columns so the attended column (up to ~1e8) does not swamp the solve.
    scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
    coef, *_ = np.linalg.lstsq(x / scale, y, rcond=None)
    return LinearFit(*(float(v) for v in coef / scale))


def decode_scale(
    samples: Sequence[tuple[float, float, float]], decode: LinearFit
) -> tuple[tuple[int, float], ...]:
    """Per decode batch size among ``samples`` (tokens, attended, seconds), measured over fitted
    seconds; empty with fewer than two batch sizes (nothing to correct between)."""
    sums: dict[int, list[float]] = {}
    for tokens, attended, seconds in samples:
        got = sums.setdefault(int(tokens), [0.0, 0.0])
        got[0] += seconds
        got[1] += max(decode.seconds(tokens, attended), 1e-6)
    if len(sums) < 2:
        return ()
    return tuple((b, measured / fitted) for b, (measured, fitted) in sorted(sums.items()))


def interpolate(points: Sequence[tuple[float, float]], x: float, extend: bool = False) -> float:
    """``points`` (increasing x) joined by straight lines, read at ``x``: the first point's
    value below it; beyond the last, its value, or with ``extend`` the last segment's line."""
    if x <= points[0][0] or len(points) == 1:
        return points[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x <= x1 or (extend and (x1, y1) == tuple(points[-1])):
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


@dataclass(frozen=True)
class StepCostModel:
    """What one step of one replica costs; ``about`` records how it was measured.
    ``decode_scale``: (batch size, factor) pairs correcting the decode fit (module docstring)."""

    prefill: LinearFit
    decode: LinearFit
    about: dict[str, Any] = field(default_factory=dict)
    decode_scale: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        sizes = [b for b, _ in self.decode_scale]
        if sizes != sorted(set(sizes)) or any(f <= 0 for _, f in self.decode_scale):
            raise CostModelError(
                f"decode_scale: increasing batch sizes with positive factors, got "
                f"{self.decode_scale}"
            )

    def decode_factor(self, batch_size: int) -> float:
        return interpolate(self.decode_scale, batch_size) if self.decode_scale else 1.0

    def step_time(self, batch: ScheduledBatch) -> float:
        tokens, attended = batch_features(batch)
        if batch.prefills:
            # Decode rows riding in a prefill step count as prompt tokens; priced by what they
            # add to a decode step instead, TTFT and TPOT came out about 9% high over 18
            # out-of-sample runs (benchmarks/README.md, "Simulator fidelity out of sample").
            seconds = self.prefill.seconds(tokens, attended, chunk_features(batch)[2])
        else:
            seconds = self.decode.seconds(tokens, attended) * self.decode_factor(tokens)
        # A fit may extrapolate below zero for tiny steps; a step never takes negative time.
        return max(seconds, 1e-6)

    def save(self, path: Path) -> None:
        data: dict[str, Any] = {
            "format": FORMAT,
            "prefill": asdict(self.prefill),
            "decode": asdict(self.decode),
            "decode_scale": [list(pair) for pair in self.decode_scale],
            "about": self.about,
        }
        from gearshift.operator.outputs import write_text

        write_text(path, json.dumps(data, indent=2) + "\n")  # whole or not at all

    @classmethod
    def load(cls, path: Path) -> StepCostModel:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CostModelError(f"cannot read the cost model {path}: {exc}") from exc
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise CostModelError(f"{path}: not a {FORMAT} file (write one with gearshift profile)")
        try:
            scale = tuple((int(b), float(f)) for b, f in data.get("decode_scale", []))
            return cls(
                LinearFit(**data["prefill"]),
                LinearFit(**data["decode"]),
                data.get("about", {}),
                scale,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CostModelError(f"{path}: {exc!r}") from None


@dataclass(frozen=True)
class StepOverhead:
    """A step cost plus what the engine that runs the steps adds to each, by the step's
    sequences: ``extra`` as (sequences, seconds) points, read between by straight lines and
    held beyond the ends. For an engine that no profile can run alone (a Tetris decode
    instance: its leader also lands KV and admits requests every step), measured on the running
    group as its steps' time less ``base``'s."""

    base: StepCost
    extra: tuple[tuple[int, float], ...]

    def __post_init__(self) -> None:
        sizes = [n for n, _ in self.extra]
        if not sizes or sizes != sorted(set(sizes)):
            raise CostModelError(f"extra: (sequences, seconds) points, sorted, got {self.extra}")

    def step_time(self, batch: ScheduledBatch) -> float:
        sequences = len(batch.decodes) + len(batch.prefills)
        return self.base.step_time(batch) + interpolate(self.extra, sequences)
