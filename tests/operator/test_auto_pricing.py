"""`policy: auto` prices like `gearshift plan` (issue 30, items 1 and 4): without a profile both
take the preset scaled by the efficiencies fitted to the recorded GPU run, through the one
``pricing.choose``, and status.auto names it."""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml
from google.protobuf import json_format

from gearshift.operator.commands import plan
from gearshift.operator.sim import auto_policy, pricing
from gearshift.operator.sim import hardware as hw_mod
from gearshift.v1 import policy_pb2

REPO = Path(__file__).resolve().parents[2]


def _auto() -> policy_pb2.AutoPolicy:
    body = yaml.safe_load((REPO / "docs/examples/auto.yaml").read_text())
    a = body["spec"]["policy"]["auto"]
    a.pop("goodput")
    a.update(gpu="H100", requests=10, policies=["static"], traffic={"rate": 1})
    return json_format.ParseDict(a, policy_pb2.AutoPolicy())


def test_auto_and_plan_price_the_same_inputs_from_the_same_scaled_preset() -> None:
    parser = argparse.ArgumentParser()
    plan.add_parser(parser.add_subparsers())
    model = REPO / "tests/sim/fixtures/llama3_8b_config.json"
    args = parser.parse_args(["plan", "--model", str(model), "--hardware", "8xH100", "--rate", "1"])
    _, by_plan, *_ = plan._inputs(args)

    choice = auto_policy.choose(_auto(), "H100", auto_policy.GroupShape(8, 8, 1))
    by_auto = choice.report.pricing
    assert by_auto is not None
    assert by_auto.hardware == by_plan.hardware
    # choice.pricing is what status.auto.pricing shows (auto_planner.run_plan copies it).
    assert by_auto.describe == by_plan.describe == choice.pricing
    assert "scaled by efficiencies fitted to" in choice.pricing
    # Not the datasheet roofline: the fitted efficiencies are applied.
    datasheet = hw_mod.preset("8xH100")
    assert by_auto.hardware.device.memory_bandwidth == (
        datasheet.device.memory_bandwidth * pricing.MEMORY_EFFICIENCY
    )
    # The candidates were simulated on that hardware.
    assert all(r.candidate.cost.hw == by_plan.hardware for r in choice.report.results)
