"""`gearshift fetch-model`: download an `hf://` source into a folder (the init container's job)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "fetch-model",
        help="download hf://org/name into a folder (HF_TOKEN authenticates, HF_ENDPOINT mirrors)",
    )
    p.add_argument("source", help="hf://org/name")
    p.add_argument("--dest", type=Path, required=True, help="folder to fill (created)")
    p.add_argument("--revision", default=None, help="commit sha, tag or branch to pin")
    p.add_argument(
        "--tokenizer-only", action="store_true", help="config and tokenizer files, no weights"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gearshift.worker.errors import ModelLoadError
    from gearshift.worker.model import source

    try:
        hub = source.HubSource.parse(args.source, args.revision)
        folder = source.fetch(hub, args.dest, os.environ.get("HF_TOKEN"), args.tokenizer_only)
    except ModelLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log.info("fetched %s into %s", args.source, folder)
    print(folder)
    return 0
