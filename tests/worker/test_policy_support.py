"""What the engine cannot run yet is refused by one function, before any process starts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from google.protobuf import json_format

from gearshift.v1 import policy_pb2
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.policies.support import check_runnable


def _policy(raw: dict) -> policy_pb2.Policy:
    return json_format.ParseDict(raw, policy_pb2.Policy())


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"seesaw": {"prefill": {"pp": 2}, "decode": {"tp": 3}}}, "spec.policy.seesaw"),
        (
            {"sidp": {"dp": 3, "wasCacheSlots": 1, "prefetchDepth": 1}},
            "spec.policy.sidp.was_cache_slots",
        ),
        ({"tetris": {"decodeTp": 1}}, "spec.policy.tetris"),
        ({"static": {"dp": 4}}, "spec.policy.static.dp"),
    ],
)
def test_unrunnable_policies_are_refused_naming_the_field(raw: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        check_runnable(_policy(raw))
    assert info.value.field == field
    assert info.value.message.startswith(f"{field}: ")


@pytest.mark.parametrize(
    "raw",
    [
        {"static": {}},
        {"static": {"tp": 2, "sp": 2, "pp": 1, "dp": 1}},
        {"static": {"tp": 2, "pp": 2}},
        {"shift": {"sp": 4, "tp": 2, "threshold": 0}},
        {"sidp": {"dp": 2, "tp": 2}},
    ],
)
def test_static_and_shift_layouts_are_runnable(raw: dict) -> None:
    check_runnable(_policy(raw))


@pytest.mark.slow
def test_gearshift_worker_refuses_an_unrunnable_seesaw_layout_before_loading_anything() -> None:
    # Seesaw runs; gears of different sizes (2 ranks for prefill, 3 for decode) never do.
    policy = {"seesaw": {"prefill": {"pp": 2, "tp": 1}, "decode": {"tp": 3, "pp": 1}}}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gearshift.operator.cli",
            "worker",
            "--policy-json",
            json.dumps(policy),
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "policy.seesaw.decode: tp × pp must equal" in done.stderr
    with pytest.raises(InvalidRequestError) as info:
        check_runnable(_policy(policy))
    assert info.value.field == "spec.policy.seesaw"  # the operator's InvalidSpec names it too


def test_a_sidp_group_is_served_on_one_node_only() -> None:
    assert check_runnable(_policy({"sidp": {"dp": 2}})).engine_replicas() == 2
    with pytest.raises(InvalidRequestError) as info:
        check_runnable(_policy({"sidp": {"dp": 2}}), nodes=2)
    assert info.value.field == "spec.group.nodes"
