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
    found = set(ROOTS.values())  # the component roots (operator/ has no __init__.py on purpose)
    for folder, name in ROOTS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]))
    assert found == listed


def test_the_operator_folder_never_shadows_the_standard_library():
    # operator/ is a namespace portion (no __init__.py): a regular module, the stdlib's, wins
    # even with the repo root first on sys.path and no site hooks ("python -m ..." from the root
    # in a fresh venv, as CI runs pip).
    import subprocess
    import sys

    code = "import operator, collections; print(operator.__file__)"
    out = subprocess.run(
        [sys.executable, "-S", "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()
    assert not out.startswith(str(ROOT)), out
    assert not (ROOT / "operator" / "__init__.py").exists()


def test_the_engine_is_an_extra_and_the_operator_image_installs_none_of_it():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [d.split(">")[0].split("=")[0].split("[")[0] for d in project["dependencies"]]
    assert "torch" not in names  # tests/operator/test_no_torch.py: nothing there needs it
    extras = project["optional-dependencies"]
    assert any(d.startswith("torch") for d in extras["worker"])
    assert any(d.startswith("gearshift[") and "worker" in d for d in extras["dev"])
    operator = (ROOT / "docker" / "operator.Dockerfile").read_text()
    assert 'pip install ".[operator]"' in operator and "torch==" not in operator
    assert 'pip install ".[worker]"' in (ROOT / "docker" / "worker.Dockerfile").read_text()
