"""`gearshift tetris-profile`: measured CDSP prefill per SP size on a local pool, fitted to
Eq. (1); its output is what a TetrisPolicy's latencyModels takes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from google.protobuf import json_format

from gearshift.operator.planner.settings import PlannerSettings
from gearshift.v1 import policy_pb2
from gearshift.worker.launch.tetris.profile import ProfilePoints


@pytest.mark.slow
def test_the_profile_measures_every_sp_size_and_its_models_load_into_a_policy(
    tiny_checkpoint, tmp_path
):
    checkpoint = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=2)
    out = tmp_path / "models.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gearshift.operator.cli",
            "tetris-profile",
            "--model",
            str(checkpoint),
            "--instances",
            "2",
            "--lengths",
            "16,32,48",
            "--histories",
            "0,24",
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert json.loads(done.stdout) == report
    # Every SP size 1..2, every (C, L) point, a positive time each.
    for sp in ("1", "2"):
        points = {(c, n) for c, n, _ in report["samples"][sp]}
        assert points == {(c, n) for c in (0, 24) for n in (16, 32, 48)}
        assert all(s > 0 for _, _, s in report["samples"][sp])
    policy = json_format.ParseDict(
        {
            "maxSp": 2,
            "powerOfTwoSp": True,
            "chunkGranularity": 16,
            "maxChunks": 2,
            "latencyModels": report["latencyModels"],
        },
        policy_pb2.TetrisPolicy(),
    )
    settings = PlannerSettings.from_proto(policy)
    assert sorted(settings.rules.models) == [1, 2]


def test_bad_profile_grids_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match="three lengths and two histories"):
        ProfilePoints((0, 8), (16, 32)).check(256)
    with pytest.raises(ValueError, match="exceeds the model's 64 positions"):
        ProfilePoints((0, 32), (16, 24, 40)).check(64)
    done = subprocess.run(
        [sys.executable, "-m", "gearshift.operator.cli", "tetris-profile", "--instances", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2 and "--instances must be at least 1" in done.stderr
