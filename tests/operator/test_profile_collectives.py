"""``gearshift profile --layouts`` times each multi-rank layout's collectives inside its running
group (issue 30, item 1): the session's real CPU profile (cpu_profile.py: tp2 and pp2 of a tiny
random Llama over gloo) carries them, and they read back through the profile reader."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gearshift.operator.cli import build_parser
from gearshift.operator.commands.profile_layouts import collective_grid
from gearshift.operator.sim import calibration
from gearshift.operator.sim.profile import COLLECTIVE_REPEATS, COLLECTIVE_SIZES, CollectiveGrid


def test_each_two_rank_layout_records_its_timed_collectives(cpu_profile: str) -> None:
    profile = calibration.parse(cpu_profile, "cpu profile")
    used = {name: set(lp.collectives) for name, lp in profile.layouts.items()}
    assert used == {"tp2": {"all_reduce"}, "pp2": {"send_recv"}}
    for lp in profile.layouts.values():
        for measured in lp.collectives.values():
            assert measured.ranks == 2
            sizes = [b for b, _ in measured.points]
            # The default grid, each size rounded to whole float32 elements per rank.
            assert sizes == sorted(sizes) and len(sizes) == len(COLLECTIVE_SIZES)
            assert all(abs(b - s) <= 8 for b, s in zip(sizes, COLLECTIVE_SIZES, strict=True))
            # Each point measured. Whether the times grow with the size (so that links.fit
            # finds a link) is a timing: tests/sim/test_collective_links.py fits known points.
            assert all(t > 0 for _, t in measured.points)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--collective-sizes", "4KiB"], "--collective-sizes: at least two distinct sizes"),
        (["--collective-sizes", "4KB,1MiB"], "--collective-sizes: '4KB' is not a byte count"),
        (["--collective-repeats", "0"], "--collective-repeats: at least 1"),
    ],
)
def test_a_bad_collective_grid_is_refused(flags: list[str], message: str) -> None:
    args = build_parser().parse_args(["profile", "--layouts", "tp2", *flags, "-o", "p.json"])
    with pytest.raises(ValueError, match=re.escape(message)):
        collective_grid(args)


def test_the_collective_grid_is_read_from_its_flags() -> None:
    args = build_parser().parse_args(
        ["profile", "--layouts", "tp2", "--collective-sizes", "1MiB,4096,64KiB",
         "--collective-repeats", "3", "-o", "p.json"]
    )  # fmt: skip
    assert collective_grid(args) == CollectiveGrid((4096, 65536, 1 << 20), 3)
    default = build_parser().parse_args(["profile", "--layouts", "tp2", "-o", "p.json"])
    assert collective_grid(default) == CollectiveGrid(COLLECTIVE_SIZES, COLLECTIVE_REPEATS)


def test_the_collective_grid_needs_layouts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = build_parser().parse_args(
        ["profile", "--collective-repeats", "3", "-o", str(tmp_path / "p.json")]
    )
    assert args.func(args) == 2
    assert "--collective-repeats: only with --layouts" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_the_engine_version_comes_from_the_checkout_when_not_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gpu_check.sh runs the checkout on the path, not installed: a profile still names the
    engine's version (pyproject.toml's), the one the installed package reports."""
    import importlib.metadata

    from gearshift.operator.commands import profile_layouts

    installed = importlib.metadata.version("gearshift")

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert profile_layouts.engine_version() == installed
