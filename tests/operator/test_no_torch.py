"""The operator, the simulator and the router import no torch, and run without it: the operator
image ships without torch (docker/operator.Dockerfile). Each check runs in a subprocess where
``import torch`` fails."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

NO_TORCH = """
import importlib, json, pkgutil, sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch is not installed in the operator image ({name})")
        return None

sys.meta_path.insert(0, NoTorch())
"""


def _run(code: str, timeout: float = 300) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", NO_TORCH + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_every_operator_module_imports_where_torch_cannot() -> None:
    out = _run("""
        import gearshift.operator as root
        failed = []
        names = [
            m.name
            for m in pkgutil.walk_packages(
                root.__path__, "gearshift.operator.", onerror=lambda n: failed.append(n)
            )
        ]
        for name in names:
            try:
                importlib.import_module(name)
            except Exception as exc:
                failed.append(f"{name}: {exc!r}")
        print(json.dumps({"names": names, "failed": failed, "torch": "torch" in sys.modules}))
    """)
    assert out["failed"] == []
    assert out["torch"] is False
    names = set(out["names"])
    # The walk reached every component, the simulator and the CLI included.
    for name in (
        "gearshift.operator.cli",
        "gearshift.operator.reconcile.reconciler",
        "gearshift.operator.reconcile.auto",
        "gearshift.operator.router.server",
        "gearshift.operator.sim.seesaw_sim",
        "gearshift.operator.sim.tetris_sim",
        "gearshift.operator.sim.reproduce.sidp",
        "gearshift.operator.commands.worker",
    ):
        assert name in names


def test_the_operator_plans_checks_and_routes_every_policy_kind_without_torch() -> None:
    out = _run("""
        from gearshift.operator.cli import build_parser
        from gearshift.operator.reconcile.reconciler import runnable_spec
        from gearshift.operator.router.policy_control import PolicyControl, RequestPlanning
        from gearshift.operator.sim import auto_policy
        from gearshift.v1 import policy_pb2, worker_pb2
        from gearshift.worker.policies import checks
        from gearshift.worker.policies.policy_json import parse_policy
        from pathlib import Path

        import yaml

        build_parser()  # `gearshift router` runs from the operator image
        # `policy: auto` simulates every kind, Seesaw's and Tetris's schedulers included.
        auto = policy_pb2.AutoPolicy()
        auto.model.num_hidden_layers, auto.model.hidden_size = 32, 4096
        auto.model.num_attention_heads, auto.model.num_key_value_heads = 32, 8
        auto.model.intermediate_size, auto.model.vocab_size = 14336, 128256
        auto.traffic.rate = 0.5
        auto.traffic.prompt.fixed, auto.traffic.output.fixed = 256, 16
        auto.requests = 10
        choice = auto_policy.choose(auto, "H100", auto_policy.GroupShape(4, 4, 1))
        simulated = sorted({line["name"] for line in choice.considered})
        # The reconciler's InvalidSpec rule for every example.
        kinds = []
        for path in sorted(Path("docs/examples").glob("*.yaml")):
            body = yaml.safe_load(path.read_text())
            if "auto" in body["spec"]["policy"]:
                continue
            body["metadata"]["namespace"] = "ns"
            kinds.append(next(iter(runnable_spec(body).policy.ListFields()))[0].name)
        # The router's per-kind classes (SiDP's controller, Tetris's planner).
        made = {}
        for kind in ("sidp", "tetris"):
            stats = worker_pb2.WorkerStats(
                policy=checks.with_defaults(parse_policy({kind: {}}), 2)
            )
            control, planning = PolicyControl(), RequestPlanning()
            control.decide(stats)
            try:
                planning.plan_into(stats, worker_pb2.WorkerGenerateRequest(), 1)
            except ValueError:
                pass
            made[kind] = [type(control.controller).__name__, type(planning.planner).__name__]
        print(json.dumps({
            "simulated": simulated, "kinds": kinds, "made": made, "torch": "torch" in sys.modules
        }))
    """)
    assert out["torch"] is False
    for kind in ("seesaw", "tetris", "sidp", "shift"):
        assert any(name.startswith(kind) for name in out["simulated"]), out["simulated"]
    assert set(out["kinds"]) == {"static", "shift", "seesaw", "sidp", "tetris"}
    assert out["made"] == {
        "sidp": ["ServedGroupControl", "NoneType"],
        "tetris": ["NoneType", "TetrisRequestPlanner"],
    }
