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


def _test_file(name: str) -> Path:
    """A test file named in docs/security.md: a path from the root, or a unique file name."""
    if (ROOT / name).is_file():
        return ROOT / name
    found = list((ROOT / "tests").rglob(name))
    assert len(found) == 1, f"docs/security.md names {name}: found {found}"
    return found[0]


def test_security_page_names_tests_that_exist_and_every_item_of_issue_31():
    """Every `file.py::test_name` (or `::test_name`, the row's last file) in docs/security.md
    is a test defined there, so the page cannot claim a test that was renamed or removed."""
    import re

    page = (ROOT / "docs" / "security.md").read_text()
    for item in range(1, 11):
        assert re.search(rf"^## {item}\. ", page, re.M), f"docs/security.md lacks item {item}"
    checked = 0
    for row in (ln for ln in page.splitlines() if ln.startswith("| ")):
        current: Path | None = None
        for token in re.findall(r"`([^`]+)`", row):
            file, sep, test = token.partition("::")
            if file.endswith(".py"):
                current = _test_file(file)
            if sep:
                assert current is not None, f"{token}: which file? ({row[:60]})"
                source = current.read_text()
                assert re.search(rf"^(async )?def {test}\(", source, re.M), f"{current}: {test}"
                checked += 1
    assert checked >= 40
