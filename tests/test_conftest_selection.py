"""The suite's own selection logic (tests/conftest.py): whether a run takes in the one test that
needs vLLM's venv, which decides whether its install starts in the background at session start.
It reads pytest's private marker-expression parser; a change there must fall back to "not
selected" (the test then installs when it asks), never fail the run."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import conftest

ROOT = Path(conftest.__file__).parents[1]


def _config(markexpr: str = "", keyword: str = "", args: list[str] | None = None) -> object:
    return SimpleNamespace(
        option=SimpleNamespace(keyword=keyword, markexpr=markexpr),
        invocation_params=SimpleNamespace(dir=ROOT),
        args=args if args is not None else ["tests"],
    )


@pytest.mark.parametrize(
    ("markexpr", "keyword", "args", "selected"),
    [
        ("", "", ["tests"], True),
        ("slow", "", ["tests"], True),
        ("not slow", "", ["tests"], False),  # make test-fast
        ("serial", "", ["tests"], False),
        ("not serial", "", ["tests"], True),
        ("", "", ["tests/e2e/test_vllm_backend.py::test_x"], True),
        ("", "", ["tests/sim"], False),
        ("", "vllm", ["tests"], False),  # a -k expression is not evaluated
    ],
)
def test_which_runs_take_in_the_vllm_test(
    markexpr: str, keyword: str, args: list[str], selected: bool
) -> None:
    assert conftest._selects_the_vllm_test(_config(markexpr, keyword, args)) is selected


def test_a_changed_private_parser_means_not_selected(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = SimpleNamespace()  # no Expression: as if pytest had moved it
    monkeypatch.setitem(sys.modules, "_pytest.mark.expression", broken)
    assert conftest._selects_the_vllm_test(_config("slow")) is False
    # Without a marker expression the parser is not needed.
    assert conftest._selects_the_vllm_test(_config("")) is True
