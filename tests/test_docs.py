"""Docs that must stay true: the module map lists every module, the README its two commands."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_architecture_page_lists_every_module():
    page = (ROOT / "docs" / "architecture.md").read_text()
    missing = []
    for folder in ("worker", "operator", "proto/gearshift/v1"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "__init__.py" or "_pb2" in path.name:
                continue
            section = f"### `{path.parent.relative_to(ROOT)}/`"
            if (
                section not in page
                or f"| `{path.name}` |" not in page.split(section, 1)[1].split("###", 1)[0]
            ):
                missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"add these to docs/architecture.md: {missing}"


def test_readme_opens_with_the_main_job_and_the_test_command():
    readme = (ROOT / "README.md").read_text()
    first_block = readme.split("```bash", 1)[1].split("```", 1)[0]
    assert "make serve" in first_block and "make test" in first_block
    makefile = (ROOT / "Makefile").read_text()
    assert "\nserve:" in makefile and "\ntest:" in makefile
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci
