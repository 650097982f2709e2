"""``gearshift generate`` end to end in a subprocess."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gearshift.operator.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.slow
def test_generate_prints_the_greedy_chat_completion():
    res = _run(
        "generate",
        "--model",
        "smollm2",
        "--chat",
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "16",
        "--dtype",
        "float32",
    )
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout
    assert "Loading weights" in res.stderr  # progress goes to stderr, the text to stdout


@pytest.mark.slow
def test_generate_names_an_unknown_model():
    res = _run("generate", "--model", "/nonexistent/model", "--prompt", "hi")
    assert res.returncode == 2
    assert "/nonexistent/model" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.slow
def test_generate_names_an_invalid_sampling_value():
    res = _run("generate", "--prompt", "hi", "--temperature", "-2")
    assert res.returncode == 2
    assert "temperature" in res.stderr and "Traceback" not in res.stderr
