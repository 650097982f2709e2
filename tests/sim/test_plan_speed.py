"""`gearshift plan` with its defaults for a random 3-layer Qwen3 on 8xH200 at 4 req/s (issue 30,
item 5): it prunes what cannot change the recommendation and answers with a full report. The
time itself is benchmarks/plan_speed.py's figure; the timeout here only guards against a hang."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

QWEN3 = Path(__file__).parent / "fixtures" / "random_qwen3_3layer_config.json"


@pytest.mark.timeout(900)
def test_the_default_plan_prunes_and_reports_every_candidate(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    cmd = [
        sys.executable, "-m", "gearshift.operator.cli", "plan", "--model", str(QWEN3),
        "--hardware", "8xH200", "--rate", "4", "--no-progress", "-o", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=850, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(out.read_text())
    cands = data["candidates"]
    assert len(cands) == 17  # one, TP/SP/PP/Shift 2, SiDP, Seesaw, Tetris shapes
    pruned = [c for c in cands if c["pruned"]]
    # TP and SP pay collectives' latencies a 3-layer model cannot hide: their no-queueing
    # p99 TTFT alone is outside the band of the best's.
    assert data["pruned_candidates"] == len(pruned) >= 5
    assert {"tp2x4", "sp2x4", "shift2x4"} <= {c["name"] for c in pruned}
    assert all(c["points"] == [] and c["lower_bound"]["ttft_p99_s"] > 0 for c in pruned)
    ran = [c for c in cands if not c["pruned"]]
    # No SLO: only the declared rate decides, so only it is simulated.
    assert all([p["rate"] for p in c["points"]] == [4.0] for c in ran)
    assert data["simulated_points"] == len(ran)
    assert data["recommended"] in {c["name"] for c in ran}
    assert not data["ties"] or data["ties"][0] == data["recommended"]
    assert all("error_band" in p for c in ran for p in c["points"])
    assert f"pruned: {len(pruned)} of 17 candidates" in done.stdout


FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("model", "hardware", "extra"),
    [
        ("llama3_8b", "8xH200", ["--rate", "4"]),
        ("llama3_70b", "8xH200", ["--rate", "4"]),
        # With an SLO every rate of the sweep runs: a Tetris decode instance's recompute that
        # took more than one step stopped part way (a request lost at 8 and 32 req/s).
        (
            "llama3_8b",
            "8xH100PCIE",
            ["--rate", "8", "--burstiness", "2", "--goodput", "ttft:2000 tpot:100"],
        ),
    ],
    ids=["8b", "70b", "8b-pcie-slo"],
)
def test_the_default_plan_of_a_real_size_model_simulates_every_candidate(
    model: str, hardware: str, extra: list[str], tmp_path: Path
) -> None:
    """Real shapes on 8xH200 at the defaults (300 requests a point), where a small model never
    fills a decode instance: every candidate is simulated or pruned, none fails, and every
    simulated point accounts for every request (served or refused). Tetris's decode instances
    crashed the plan (a block-table row past max_num_seqs) and lost the requests they preempted,
    2026-11-28."""
    out = tmp_path / "plan.json"
    cmd = [
        sys.executable, "-m", "gearshift.operator.cli", "plan", "--model",
        str(FIXTURES / f"{model}_config.json"), "--hardware", hardware, "--no-progress",
        "-o", str(out), *extra,
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=550, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(out.read_text())
    assert all(c["error"] is None for c in data["candidates"]), [
        (c["name"], c["error"]) for c in data["candidates"] if c["error"]
    ]
    points = [p for c in data["candidates"] for p in c["points"]]
    assert points and all(p["requests"] + p["rejected"] == 300 for p in points)
    assert any(c["name"].startswith("tetris") and c["points"] for c in data["candidates"])
    best = next(c for c in data["candidates"] if c["name"] == data["recommended"])
    # The pick served every request. (70B: two Tetris shapes refused some until requests with
    # no decode room waited for it, as in the router; now they serve all, slowly.)
    assert next(p for p in best["points"] if p["declared"])["rejected"] == 0
