"""`gearshift serve` refuses bad flags before starting anything, naming each one."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--groups", "0"], "--groups must be >= 1"),
        (["--num-threads", "0"], "--num-threads must be >= 1, got 0"),
        (["--prefill-threads", "-2"], "--prefill-threads must be >= 1, got -2"),
        (["--shift-threshold", "64"], "--shift-threshold is not a field of the static policy"),
        (["--policy-config", '{"static": {}}', "--tp", "2"], "drop --tp"),
        (["--policy-config", '{"tetris": {}}'], "no prefill instance fits"),
        (["--policy-config", '{"auto": {}}'], "planned by the operator"),
        (["--policy", "auto"], "planned by the operator"),
        (["--policy-config", '{"static": {"dp": 2}}'], "spec.policy.static.dp"),
    ],
)
def test_bad_flags_exit_2_with_the_flag_named(flags, message):
    done = subprocess.run(
        [sys.executable, "-m", "gearshift.operator.cli", "serve", "--port", "0", *flags],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
