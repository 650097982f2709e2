"""`gearshift plan`'s extras (issue 16, item 3): SiDP's B_th per shape and Tetris's request-rate
→ improvement-rate table, with Eq. (1) fitted from the roofline for the hardware at hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from google.protobuf import json_format

from gearshift.operator.sim import hardware, model_desc, tetris_models
from gearshift.operator.sim.plan_extras import tetris_pool
from gearshift.v1 import policy_pb2

FIXTURES = Path(__file__).parent / "fixtures"
LLAMA_8B, LLAMA_70B = FIXTURES / "llama3_8b_config.json", FIXTURES / "llama3_70b_config.json"


def _plan(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "gearshift.operator.cli", "plan", *args, "--no-progress"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)


ARGS = (
    "--model", str(LLAMA_8B), "--hardware", "8xH200", "--rate", "4", "--requests", "20",
    "--prompt-len", "tetris-short", "--output-len", "64", "--rates", "1,4", "--policies", "static",
)  # fmt: skip


def test_plan_prints_b_th_and_the_tetris_table_and_writes_them(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    done = _plan(*ARGS, "-o", str(out), "--tetris-rates", "0.02,40")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "SiDP B_th" in done.stdout and "tp 2 x dp 4:" in done.stdout
    assert "Tetris improvement rate by request rate (4 prefill instances of TP 1" in done.stdout
    data = json.loads(out.read_text())
    shapes = {(r["tp"], r["dp"]) for r in data["sidp_b_th"]}
    assert shapes == {(1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (4, 2)}
    assert all(r["tokens"] is None or r["tokens"] >= 1 for r in data["sidp_b_th"])
    tet = data["tetris_improvement_rates"]
    rows = tet["improvementRateTable"]
    assert [r["requestRate"] for r in rows] == [0.02, 40.0]
    # An idle pool takes the largest SP that helps; a loaded one asks more of a larger SP.
    assert rows[0]["improvementRate"] == 0.0 < rows[1]["improvementRate"]
    # The rows are a TetrisPolicy's table as the CRD takes it, and so are the Eq. (1) models.
    policy = json_format.ParseDict(
        {"tetris": {"improvementRateTable": tet["improvementRateTable"],
                    "latencyModels": tet["latency_models"]}},
        policy_pb2.Policy(),
    )  # fmt: skip
    assert len(policy.tetris.improvement_rate_table) == 2
    assert [m.sp for m in policy.tetris.latency_models] == [1, 2, 4]
    # --no-extras skips both; a bad --sidp-context is refused naming it.
    quiet = _plan(*ARGS, "--no-extras")
    assert quiet.returncode == 0 and "B_th" not in quiet.stdout
    for flag, value in (
        ("--sidp-context", "0"),
        ("--tetris-rates", "1,x"),
        ("--tetris-rates", "0"),
    ):
        bad = _plan(*ARGS, flag, value)
        assert bad.returncode == 2 and flag in bad.stderr, bad.stderr


def test_eq1_fit_follows_the_roofline_and_more_sp_prefills_faster() -> None:
    model, hw = model_desc.load(LLAMA_8B), hardware.load("8xH200")
    fits = {s: tetris_models.fit(model, hw, s) for s in (1, 2, 4)}
    for m in fits.values():
        assert min(m.a, m.b, m.c, m.d) >= 0
        assert tetris_models.fit_error(model, hw, m) < 0.3
    long = [fits[s].seconds(32768, 16384) for s in (1, 2, 4)]
    assert long[0] > long[1] > long[2]
    true = tetris_models.chunk_seconds(model, hw, 2, 1, 8192, 8192)
    assert abs(fits[2].seconds(8192, 8192) - true) / true < 0.3


def test_the_pool_takes_the_smallest_tp_that_holds_the_weights() -> None:
    h200 = hardware.load("8xH200")
    assert tetris_pool(model_desc.load(LLAMA_8B), h200) == {
        "prefillInstances": 4, "prefillTp": 1, "decodeInstances": 4, "decodeTp": 1,
    }  # fmt: skip
    big = tetris_pool(model_desc.load(LLAMA_70B), h200)
    assert big is not None and big["prefillTp"] == 2 and big["prefillInstances"] == 2
    assert tetris_pool(model_desc.load(LLAMA_70B), hardware.load("1xL4")) is None
