"""`gearshift worker`: one worker group's leader (or a follower pod), as the operator runs it."""

from __future__ import annotations

import argparse
import logging
import sys

log = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from gearshift.worker.server.settings import add_worker_args

    p = sub.add_parser("worker", help="serve one worker group over gRPC (engine.json)")
    add_worker_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gearshift.worker.errors import GearshiftError
    from gearshift.worker.server.app import run_worker
    from gearshift.worker.server.settings import load_settings

    try:
        settings = load_settings(args)
    except GearshiftError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return run_worker(settings)
