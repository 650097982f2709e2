"""benchmarks/calibrated_plan.py (issue 30, "Measure" on a GPU) runs on the CPU in --smoke mode:
the profile, the replay, both plans and the report, so a GPU session finds a script that works."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "calibrated_plan.py"


def _run(tmp_path: Path, *extra: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--out", str(tmp_path), *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_the_calibrated_plan_benchmark_runs_in_smoke_mode(tmp_path: Path) -> None:
    done = _run(tmp_path, "--hardware", "1xH200", "--repeats", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "calibrated_plan.json").read_text())
    assert report["device_kind"] == "cpu" and report["uncalibrated_meaningful"] is False
    assert "means nothing" in done.stdout
    assert list(report["profile"]["layouts"]) == ["one"]
    calibrated, uncalibrated = report["plans"]["calibrated"], report["plans"]["uncalibrated"]
    assert calibrated["pricing"].startswith("the profile of ")
    assert "--profile" in calibrated["command"]
    assert "H200 preset scaled by efficiencies" in uncalibrated["pricing"]
    measured = report["measured"]
    # The replay ran the plan's own trace: the same output tokens in all (throughput x makespan).
    out_tokens = report["trace_output_tokens"]
    assert report["replayed_output_tokens"] == [out_tokens, out_tokens]
    for plan in (calibrated, uncalibrated):
        fig = plan["figures"]
        assert abs(fig["output_tokens_per_s"] * fig["makespan_s"] - out_tokens) < 1e-6 * out_tokens
        for name, m in measured.items():
            assert m["min"] <= m["mean"] <= m["max"] and m["min"] > 0, name
            err = plan["errors"][name]
            assert err["error"] == fig[name] / m["mean"] - 1
            assert abs(err["worst_error"]) >= abs(fig[name] / m["max"] - 1) - 1e-12
    # The two plans priced differently: a GPU preset prices this model far faster than this CPU.
    assert uncalibrated["figures"]["tpot_p50_s"] < calibrated["figures"]["tpot_p50_s"] / 5


def test_without_a_preset_the_uncalibrated_plan_is_named_as_not_run(tmp_path: Path) -> None:
    done = _run(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "calibrated_plan.json").read_text())
    assert list(report["plans"]) == ["calibrated"]
    assert report["uncalibrated"].startswith("no preset for ")


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--repeats", "0"], "--repeats"),
        (["--layers", "0"], "--layers"),
        (["--batched-tokens", "-1"], "--batched-tokens"),
        (["--rate", "0"], "--rate"),
    ],
)
def test_a_bad_setting_is_refused_naming_it(tmp_path: Path, flags: list[str], named: str) -> None:
    done = _run(tmp_path, *flags, timeout=60)
    assert done.returncode == 2 and named in done.stderr
    assert not (tmp_path / "calibrated_plan.json").exists()


def test_an_unknown_preset_is_refused_before_profiling(tmp_path: Path) -> None:
    done = _run(tmp_path, "--hardware", "1xNOPE", timeout=60)
    assert done.returncode == 1 and "--hardware 1xNOPE" in done.stderr
    assert "profiled" not in done.stderr  # gearshift profile never ran
    assert not (tmp_path / "calibrated_plan.json").exists()
