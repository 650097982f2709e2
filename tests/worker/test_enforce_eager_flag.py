"""``--enforce-eager`` (vLLM's flag) on generate, serve and worker reaches the engine config."""

from __future__ import annotations

import argparse
from pathlib import Path

from gearshift.operator.cli import build_parser
from gearshift.operator.commands.serve import _worker_args
from gearshift.worker.server.settings import add_worker_args, engine_config, load_settings


def test_generate_and_serve_take_enforce_eager_into_the_engine_config() -> None:
    parser = build_parser()
    for argv in (
        ["generate", "--model", "m", "--enforce-eager", "--prompt", "hi"],
        ["serve", "m", "--enforce-eager"],
    ):
        args = parser.parse_args(argv)
        args.model = args.model or "m"
        assert engine_config(args).enforce_eager is True
    args = parser.parse_args(["serve", "m"])
    args.model = "m"
    assert engine_config(args).enforce_eager is False


def test_serve_passes_enforce_eager_to_its_workers(tmp_path: Path) -> None:
    parser = build_parser()
    eager = _worker_args(
        parser.parse_args(["serve", "m", "--enforce-eager"]), tmp_path / "e.json", 1
    )
    assert "--enforce-eager" in eager
    plain = _worker_args(parser.parse_args(["serve", "m"]), tmp_path / "e.json", 1)
    assert "--enforce-eager" not in plain


def test_worker_settings_carry_enforce_eager() -> None:
    p = argparse.ArgumentParser()
    add_worker_args(p)
    assert load_settings(p.parse_args(["--enforce-eager"]), env={}).engine.enforce_eager is True
    assert load_settings(p.parse_args([]), env={}).engine.enforce_eager is False
