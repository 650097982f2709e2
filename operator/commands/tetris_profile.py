"""`gearshift tetris-profile`: measure CDSP prefill on a local pool of instances, or on a running
Tetris group's own pool (`--worker`, the Worker.ProfileTetris call), and print the Eq. (1) latency
models (one per SP size) that a TetrisPolicy's `latencyModels` takes (§5.1)."""

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
    p.add_argument(
        "--model", default=None, help="model folder, .gguf file, or 'smollm2' (default smollm2)"
    )
    p.add_argument(
        "--instances", type=int, default=None, help="local prefill instances (TP 1 each; default 2)"
    )
    p.add_argument(
        "--worker",
        metavar="HOST:PORT",
        help="profile a running tetris group's pool through its leader's worker gRPC port (e.g. "
        "after kubectl port-forward) instead of a local pool; the probes queue with its traffic",
    )
    p.add_argument(
        "--token-file",
        type=Path,
        help="the deployment's control token for --worker (default $GEARSHIFT_CONTROL_TOKEN_FILE)",
    )
    p.add_argument(
        "--sp-sizes", type=_ints, default=(), help="--worker: SP sizes (default 1..its pool)"
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="--worker: seconds for the call")
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


def _remote(args: argparse.Namespace) -> dict[int, list[tuple[int, int, float]]] | int:
    """Samples by SP size from Worker.ProfileTetris, or an exit code after printing why not."""
    import os

    import grpc

    from gearshift.v1 import worker_pb2, worker_pb2_grpc
    from gearshift.worker.server import auth

    token_file = args.token_file or os.environ.get(auth.TOKEN_FILE_ENV)
    try:
        token = auth.read_token(token_file) if token_file else None
    except auth.TokenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    request = worker_pb2.ProfileTetrisRequest(
        sp_sizes=args.sp_sizes,
        histories=args.histories,
        lengths=args.lengths,
        repeats=args.repeats,
    )
    try:
        with grpc.insecure_channel(args.worker) as channel:
            reply = worker_pb2_grpc.WorkerStub(channel).ProfileTetris(
                request, timeout=args.timeout, metadata=auth.call_metadata(token)
            )
    except grpc.RpcError as exc:
        print(f"error: {args.worker}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 2 if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    samples: dict[int, list[tuple[int, int, float]]] = {}
    for s in reply.samples:
        samples.setdefault(s.sp, []).append((s.history, s.length, s.seconds))
    return samples


def run(args: argparse.Namespace) -> int:
    if args.worker is not None:
        stray = [f for f, v in (("--model", args.model), ("--instances", args.instances)) if v]
        if stray:
            print(
                f"error: {', '.join(stray)} describe a local pool; --worker profiles the "
                "running group's own model and instances",
                file=sys.stderr,
            )
            return 2
        from gearshift.worker.launch.tetris.profile import ProfilePoints

        try:  # what the fit needs; the worker checks the model's positions
            ProfilePoints(args.histories, args.lengths, args.repeats).check()
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        got = _remote(args)
        if isinstance(got, int):
            return got
        models = fit(got)
        return _report(args, f"worker {args.worker}", models, got)
    if args.sp_sizes:
        print("error: --sp-sizes needs --worker (locally: --instances)", file=sys.stderr)
        return 2
    args.model = args.model or "smollm2"
    args.instances = 2 if args.instances is None else args.instances
    import torch

    from gearshift.worker.config import EngineConfig
    from gearshift.worker.engine.loading import inspect_model
    from gearshift.worker.errors import GearshiftError
    from gearshift.worker.launch.tetris.profile import ProfilePoints, profile_pool

    points = ProfilePoints(args.histories, args.lengths, args.repeats)
    try:
        spec, source = inspect_model(EngineConfig(model=args.model), torch.device("cpu"))
        source.close()
        if args.instances < 1:
            raise ValueError(f"--instances must be at least 1, got {args.instances}")
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
    return _report(args, str(spec.path), fit(samples), samples)


def _report(
    args: argparse.Namespace,
    source: str,
    models: list[dict[str, float]],
    samples: dict[int, list[tuple[int, int, float]]],
) -> int:
    report = {
        "model": source,
        "latencyModels": [{k: v for k, v in m.items() if k != "fitRmsError"} for m in models],
        "fitRmsError": {str(m["sp"]): m["fitRmsError"] for m in models},
        "samples": {str(sp): rows for sp, rows in samples.items()},
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.output is not None:
        args.output.write_text(text + "\n")
    return 0
