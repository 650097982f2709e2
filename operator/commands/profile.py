"""`gearshift profile`: time the real engine's steps on this machine and save the step-cost fit
that the simulator loads (gearshift.operator.sim.cost_model); with ``--layouts``, one fit per
layout in a calibration profile that `gearshift plan --profile` prices from (sim/calibration.py)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gearshift.operator.sim.profile import ProfileGrid


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from gearshift.worker.policies.flags import add_policy_args
    from gearshift.worker.server.settings import add_engine_args

    p = sub.add_parser("profile", help="time prefill and decode steps; save the cost-model fit")
    p.add_argument("--model", default="smollm2", help="model folder, .gguf file, or 'smollm2'")
    add_engine_args(p)
    add_policy_args(p, world_size=True)
    p.add_argument("--output", "-o", type=Path, required=True, help="the fit, as JSON")
    p.add_argument(
        "--quick", action="store_true", help="a small grid (about a minute on a small model)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--layouts",
        default=None,
        help="comma-separated layouts (one, tp2, sp2, pp2, shift2, ...): profile each and write "
        "a calibration profile for gearshift plan --profile (no policy flags with it)",
    )
    p.add_argument(
        "--collective-sizes",
        default=None,
        help="with --layouts: comma-separated message sizes in bytes (suffix KiB or MiB allowed) "
        "to time each multi-rank layout's collectives at (default 4KiB,64KiB,1MiB,16MiB)",
    )
    p.add_argument(
        "--collective-repeats",
        type=int,
        default=None,
        help="with --layouts: timed calls per collective and size, median taken (default 5)",
    )
    p.add_argument(
        "--configmap",
        default=None,
        help="with --layouts: also write the profile into this ConfigMap's profile.json, as the "
        "pod's service account (the operator's calibration Job)",
    )
    p.set_defaults(func=run_interruptible)


def run_interruptible(args: argparse.Namespace) -> int:
    """``run``, stopped at any point by Ctrl-C or SIGTERM (interrupts.py): every rank ends, and
    the exit code is 130 (143)."""
    from gearshift.operator.commands.interrupts import interruptible, report

    try:
        with interruptible():
            return run(args)
    except KeyboardInterrupt as exc:
        return report(exc)


def quick_grid() -> ProfileGrid:
    """The small grid of ``--quick``."""
    from gearshift.operator.sim.profile import ProfileGrid

    return ProfileGrid(
        prompt_lens=(16, 64, 160),
        prefill_batches=(1, 3),
        decode_batches=(1, 8),
        contexts=(16, 160),
        decode_steps=4,
        repeats=1,
    )


def run(args: argparse.Namespace) -> int:
    from gearshift.operator import outputs
    from gearshift.operator.sim.cost_model import CostModelError
    from gearshift.operator.sim.profile import ProfileGrid, measure
    from gearshift.worker.errors import GearshiftError
    from gearshift.worker.launch import start_engine
    from gearshift.worker.policies import policy_json
    from gearshift.worker.policies.flags import policy_from_args
    from gearshift.worker.server.settings import engine_config

    try:
        # Before the minutes of profiling: a path that cannot be written would lose them.
        outputs.check(args.output, "--output")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    grid = quick_grid() if args.quick else ProfileGrid()
    if args.layouts is not None:
        from gearshift.operator.commands.profile_layouts import run_layouts

        return run_layouts(args, grid)
    for flag in ("configmap", "collective_sizes", "collective_repeats"):
        if getattr(args, flag, None) is not None:
            name = "--" + flag.replace("_", "-")
            print(f"error: {name}: only with --layouts (a calibration profile)", file=sys.stderr)
            return 2
    try:
        config = engine_config(
            args,
            # Profiling prompts are random; a prefix hit would only shorten steps unevenly.
            enable_prefix_caching=False,
            skip_tokenizer_init=True,  # the profile sends token ids
        )
        policy = policy_from_args(args)
        engine = start_engine(config, policy)
    except (GearshiftError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        profile = measure(engine, grid, args.seed)
        about = {
            "model": args.model,
            "dtype": str(config.dtype),
            "policy": policy_json.to_dict(policy),
            "block_size": engine.blocks.block_size,
            "kv_blocks": engine.blocks.num_blocks,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "max_model_len": engine.max_model_len,
            "host": platform.node(),
            "cpus": os.cpu_count(),
        }
        model = profile.model(about)
    except CostModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        engine.shutdown()
    fit = json.dumps({"prefill": vars(model.prefill), "decode": vars(model.decode)})
    try:
        model.save(args.output)  # whole or not at all
    except OSError as exc:
        print(f"error: --output {args.output}: cannot write: {exc}", file=sys.stderr)
        print(fit)  # the fit is not lost: its coefficients on stdout
        return 1
    print(fit)
    return 0
