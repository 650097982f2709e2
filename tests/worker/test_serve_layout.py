"""`gearshift serve --layout fastest`: one rank on a small CPU, and it says so."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gearshift.operator.commands.layout import choose_serve_layout, model_heads


@pytest.mark.parametrize("cores", [1, 2, 4])
def test_a_small_cpu_runs_one_static_rank_and_says_why(cores: int) -> None:
    chosen = choose_serve_layout(cores, num_heads=9, num_kv_heads=3)
    assert (chosen.policy, chosen.tp, chosen.sp) == ("static", 1, 1)
    assert f"{cores} core(s)" in chosen.reason and "small CPU" in chosen.reason


def test_heads_that_allow_no_tp_keep_one_rank() -> None:
    chosen = choose_serve_layout(32, num_heads=13, num_kv_heads=13)  # prime, > 32 // 4
    assert (chosen.tp, chosen.sp) == (1, 1)
    assert "13 heads" in chosen.reason


def test_a_big_cpu_gets_the_largest_tp_the_heads_and_cores_allow() -> None:
    assert choose_serve_layout(16, num_heads=9, num_kv_heads=3).tp == 3
    assert choose_serve_layout(16, num_heads=32, num_kv_heads=8).tp == 4
    assert choose_serve_layout(12, num_heads=32, num_kv_heads=8).tp == 2
    assert choose_serve_layout(6, num_heads=32, num_kv_heads=8).tp == 1


def test_smollm2_heads_are_read_without_torch() -> None:
    code = (
        "import sys; from gearshift.operator.commands.layout import model_heads; "
        "print(model_heads('smollm2'), 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.split() == ["(9,", "3)", "False"]
    assert model_heads("smollm2") == (9, 3)


def test_layout_fastest_refuses_explicit_sizes() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gearshift.operator.cli",
            "serve",
            "--layout",
            "fastest",
            "--sp",
            "3",
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--layout fastest picks the policy itself" in done.stderr
