"""`gearshift tetris-profile`: measure CDSP prefill on a local pool of instances and print the
Eq. (1) latency models (one per SP size) that a TetrisPolicy's `latencyModels` takes (§5.1)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"a comma-separated list of integers: {text!r}") from exc


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "tetris-profile",
        help="time CDSP prefill per SP size on local instances; print Eq. (1) latency models",
    )
    p.add_argument("--model", default="smollm2", help="model folder, .gguf file, or 'smollm2'")
    p.add_argument("--instances", type=int, default=2, help="prefill instances (TP 1 each)")
    p.add_argument("--lengths", type=_ints, default=(256, 512, 1024), help="chunk tokens L")
    p.add_argument("--histories", type=_ints, default=(0, 512, 1024), help="history tokens C")
    p.add_argument("--repeats", type=int, default=1, help="runs of each (C, L) point")
    p.add_argument("--output", "-o", type=Path, help="also write the JSON here")
    p.set_defaults(func=run)


def fit(samples: dict[int, list[tuple[int, int, float]]]) -> list[dict[str, float]]:
    """Eq. (1) per SP size, as TetrisPolicy.latencyModels entries, with each fit's relative RMS
    error on its own samples."""
    from gearshift.operator.planner.latency_model import fit_latency_model

    models = []
    for sp, rows in sorted(samples.items()):
        m = fit_latency_model(sp, [(float(c), float(n), s) for c, n, s in rows])
        errors = [(m.seconds(c, n) - s) / s for c, n, s in rows if s > 0]
        rms = (sum(e * e for e in errors) / len(errors)) ** 0.5 if errors else 0.0
        models.append({"sp": sp, "a": m.a, "b": m.b, "c": m.c, "d": m.d, "fitRmsError": rms})
    return models


def run(args: argparse.Namespace) -> int:
    import torch

    from gearshift.worker.config import EngineConfig
    from gearshift.worker.engine.loading import inspect_model
    from gearshift.worker.errors import GearshiftError
    from gearshift.worker.policies.tetris.profile import ProfilePoints, profile_pool

    points = ProfilePoints(args.histories, args.lengths, args.repeats)
    try:
        spec, source = inspect_model(EngineConfig(model=args.model), torch.device("cpu"))
        source.close()
        if args.instances < 1:
            raise ValueError(f"--instances must be at least 1, got {args.instances}")
        if args.repeats < 1:
            raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
        points.check(spec.max_model_len)
    except (GearshiftError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"profiling SP 1..{args.instances} over histories {args.histories} x lengths "
        f"{args.lengths} ({args.repeats}x)",
        file=sys.stderr,
    )
    with tempfile.TemporaryDirectory(prefix="gearshift-tetris-profile-") as tmp:
        samples = profile_pool(str(spec.path), args.instances, points, Path(tmp))
    models = fit(samples)
    report = {
        "model": str(spec.path),
        "latencyModels": [{k: v for k, v in m.items() if k != "fitRmsError"} for m in models],
        "fitRmsError": {str(m["sp"]): m["fitRmsError"] for m in models},
        "samples": {str(sp): rows for sp, rows in samples.items()},
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.output is not None:
        args.output.write_text(text + "\n")
    return 0
