"""The wheel's package list covers every package folder (images are built from the wheel)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROOTS = {
    "worker": "gearshift.worker",
    "operator": "gearshift.operator",
    "proto/gearshift/v1": "gearshift.v1",
}


def test_every_package_folder_is_listed_in_pyproject():
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = set()
    for folder, name in ROOTS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]))
    assert found == listed


def test_no_top_level_operator_package_shadows_the_standard_library():
    import operator

    assert "site-packages" not in operator.__file__ and "gearshift" not in operator.__file__
