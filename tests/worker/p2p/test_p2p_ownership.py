"""One module owns point-to-point traffic: no file of the worker calls torch's send/receive
functions except gearshift.worker.p2p."""

from __future__ import annotations

import re
from pathlib import Path

from gearshift.worker.p2p import COMM_RULES_ENV
from tests import conftest

WORKER = Path(__file__).resolve().parents[3] / "worker"
CALLS = re.compile(r"\b(?:dist|c10d)\.(?:isend|irecv|send|recv|batch_isend_irecv|P2POp)\b")


def test_only_the_p2p_module_calls_torch_point_to_point():
    offenders = []
    for path in sorted(WORKER.rglob("*.py")):
        rel = path.relative_to(WORKER).as_posix()
        if rel.startswith("p2p/"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if CALLS.search(line):
                offenders.append(f"worker/{rel}:{n}: {line.strip()}")
    assert offenders == [], "\n".join(offenders)


def test_the_test_suite_sets_the_variable_the_ranks_read():
    assert conftest.COMM_RULES_ENV == COMM_RULES_ENV
