"""benchmarks/gpu_engine.py runs on the CPU in its tiny --smoke mode: every section it measures
on a GPU runs here too (bounded), so a GPU session finds a script that works."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_engine.py"


@pytest.mark.slow
def test_the_gpu_engine_benchmark_runs_in_smoke_mode(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_engine.json").read_text())
    assert (tmp_path / "gpu_engine.png").stat().st_size > 0
    assert report["errors"] == []
    for name in ("smoke", "smoke-small"):
        a = report[f"a_batch1_{name}"]
        assert (
            a["step_s"] > 0
            and a["of_roofline"] > 0
            and set(a["host_phases_s"])
            >= {
                "schedule",
                "plan",
                "forward",
                "sample",
                "wait",
                "outputs",
            }
        )
        graphs, eager = report[f"graphs_vs_eager_{name}"]
        assert graphs["ratio"] > 0 and eager["batch"] > 1
        assert "skipped" in report[f"fused_vs_unfused_{name}"]
    assert [r["batch"] for r in report["b_decode_batched"]] == [2, 4]
    assert [r["tokens"] for r in report["c_prefill"]] == [32, 64]
    assert report["d_fidelity_trace"] == {"skipped": "needs CUDA"}
    assert report["bars"] and all(
        b["result"] == "unmeasured (smoke run)" for b in report["bars"].values()
    )
    assert report["device_limits"]["copy_bandwidth_bytes_s"] > 0


def test_an_absent_attention_backend_is_refused_naming_the_flag(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--smoke",
            "--attention-backend",
            "nope",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2 and "--attention-backend nope" in done.stderr
