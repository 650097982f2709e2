"""A sixth policy kind is one package and one registry line.

The toy policy (tests/fixtures/toy_policy) brings its own proto message, its spec, its
worker-side class and its router-side planner and controller; nothing in gearshift names it.
Registered with one line (``kinds.register_spec``), or declared as a ``gearshift.policies``
entry point / named in ``GEARSHIFT_POLICY_PACKAGES`` for other processes, it is taken by the CRD
(schema and CEL rules), the flags and ``--policy-config``, the registry (a real generate on two
ranks through an existing gear) and the router (per-kind behaviour from its spec).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gearshift.operator.reconcile import crd as crd_module
from gearshift.operator.reconcile import crd_schema
from gearshift.operator.reconcile import spec as deployment_spec
from gearshift.operator.router.metrics import _numeric_fields
from gearshift.operator.router.policy_control import PolicyControl, RequestPlanning
from gearshift.v1 import policy_fields, worker_pb2
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.policies import checks, kinds, registry
from gearshift.worker.policies.flags import add_policy_args, policy_from_args
from gearshift.worker.policies.policy_json import parse_policy, to_dict
from gearshift.worker.policies.spec import PolicySpec
from gearshift.worker.sampling.params import SamplingParams
from tests.operator.crd_validation import validate
from tests.worker.helpers import RecordingExecutor

REPO = Path(__file__).resolve().parents[3]
TOY = "tests.fixtures.toy_policy"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
ENGINE = {"skip_tokenizer_init": True, "block_size": 4}


@pytest.fixture
def toy() -> Iterator[PolicySpec]:
    from tests.fixtures.toy_policy.spec import SPEC

    kinds.register_spec(SPEC)  # the one registry line
    try:
        yield SPEC
    finally:
        kinds.unregister_spec(SPEC.kind)


def test_nothing_outside_the_toy_package_names_it() -> None:
    word = re.compile(r"\btoy\b", re.IGNORECASE)
    for top in ("worker", "operator", "proto", "crds", "charts", "docker"):
        for path in (REPO / top).rglob("*"):
            if path.is_file() and path.suffix in (".py", ".proto", ".yaml", ".cpp", ""):
                assert not word.search(path.read_text(errors="replace")), path
    assert "toy" not in kinds.kinds()  # until a test (or a plugin declaration) adds it


def test_the_toy_message_is_what_protoc_generates(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{REPO}", f"-I{REPO / 'proto'}",
         f"--python_out={tmp_path}", "tests/fixtures/toy_policy/toy.proto"],
        check=True, timeout=120,
    )  # fmt: skip
    got = (tmp_path / "tests/fixtures/toy_policy/toy_pb2.py").read_text()
    assert got == (REPO / "tests/fixtures/toy_policy/toy_pb2.py").read_text()


def _resource(policy: dict[str, Any], gpus: int) -> dict[str, Any]:
    body = yaml.safe_load((REPO / "docs/examples/shift.yaml").read_text())
    body["metadata"]["namespace"] = "default"
    body["spec"]["policy"] = policy
    body["spec"]["group"] = {"nodes": 1, "gpusPerNode": gpus}
    return dict(body)


def test_the_crd_takes_a_toy_resource_and_refuses_a_bad_layout(toy: PolicySpec) -> None:
    crd = yaml.safe_load(crd_module.render(crd_schema.proto_comments()))
    assert validate(crd, _resource({"toy": {"maxSeqs": 4}}, 2)) == []
    assert validate(crd, _resource({"toy": {"tp": 2, "maxPromptTokens": 64}}, 2)) == []
    errors = validate(crd, _resource({"toy": {"tp": 3}}, 2))
    assert any("policy.toy: tp must equal the group's GPUs" in e for e in errors), errors
    errors = validate(crd, _resource({"toy": {"maxSeqs": 9, "maxPromptTokens": 8}}, 1))
    assert any("maxSeqs must not exceed maxPromptTokens" in e for e in errors), errors
    errors = validate(crd, _resource({"toy": {"maxSeqs": 0}}, 1))
    assert any("spec.policy.toy.maxSeqs" in e for e in errors), errors  # the schema's minimum
    errors = validate(crd, _resource({"toy": {}, "static": {}}, 1))
    assert any("set exactly one of" in e and "toy" in e for e in errors), errors
    # Its fields' descriptions are its .proto comments, as gearshift.v1's are.
    policy = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    field = policy["properties"]["policy"]["properties"]["toy"]["properties"]["maxSeqs"]
    assert "Most sequences in one engine step" in field["description"]
    assert "Live" in field["description"]
    # The operator reads and checks it the same way (its InvalidSpec rule).
    parsed = deployment_spec.parse_policy({"toy": {"tp": 3}})
    assert checks.layout_errors(parsed, 2)[0].startswith("policy.toy: tp must equal")


def _args(*argv: str) -> Any:
    import argparse

    parser = argparse.ArgumentParser()
    add_policy_args(parser, world_size=True)
    return parser.parse_args(argv)


def test_the_flags_and_policy_config_read_the_toy(toy: PolicySpec) -> None:
    short = policy_from_args(_args("--policy", "toy", "--world-size", "2", "--tp", "2"))
    assert policy_fields.kind_of(short) == "toy"
    assert policy_fields.message_of(short).tp == 2
    bare = policy_from_args(_args("--policy", "toy", "--world-size", "2"))
    assert policy_fields.message_of(bare).tp == 2  # the spec's world_field
    config = policy_from_args(_args("--policy-config", "toy:\n  tp: 2\n  maxSeqs: 1\n"))
    assert to_dict(config) == {"toy": {"tp": 2, "maxSeqs": 1}}
    assert parse_policy(to_dict(config)) == config  # engine.json round trip
    with pytest.raises(InvalidRequestError, match="is not a field of the toy policy"):
        policy_from_args(_args("--policy", "toy", "--shift-threshold", "8"))
    with pytest.raises(InvalidRequestError, match="no field named"):
        parse_policy({"toy": {"gear": 2}})
    # Live or restart, from its own options.
    full = checks.with_defaults(config, 2)
    more = checks.with_defaults(parse_policy({"toy": {"tp": 2, "maxSeqs": 3}}), 2)
    assert policy_fields.non_live_changes(full, more) == []
    assert policy_fields.changed_fields(full, more) == ["toy.max_seqs"]
    wider = checks.with_defaults(parse_policy({"toy": {"tp": 4}}), 4)
    assert policy_fields.non_live_changes(full, wider) == ["toy.tp"]
    assert to_dict(policy_fields.live_only(full)) == {
        "toy": {"maxSeqs": 1, "maxPromptTokens": 4096}
    }


def test_the_registry_builds_the_toy_which_generates_one_ranks_tokens(
    toy: PolicySpec, tiny_checkpoint: Any, group_factory: Any
) -> None:
    from tests.fixtures.toy_policy.policy import ToyPolicy

    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2)
    prompts = [[5, 6, 7, 8, 9], [1, 2, 3], [9, 8, 7, 6, 5, 4, 3]]
    reference = group_factory(folder, None, record=False, **ENGINE)
    want = [o.token_ids for o in reference.generate(prompts, GREEDY)]

    policy = registry.make_policy('{"toy": {"maxSeqs": 1}}')
    assert isinstance(policy, ToyPolicy) and policy.world_size == 1  # tp = G, G from the layout
    policy = registry.make_policy({"toy": {"maxSeqs": 1}}, 2)
    assert policy.world_size == 2 and policy.layout.tp == 2
    engine = group_factory(folder, policy, **ENGINE)
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == want
    recorder = engine.executor
    assert isinstance(recorder, RecordingExecutor)
    assert policy.steps_asked > 0
    assert max(p.num_seqs for p in recorder.submitted) == 1  # its say (maxSeqs 1) was obeyed
    assert policy_fields.kind_of(engine.policy.to_proto()) == "toy"
    engine.policy.update_live({"max_seqs": 2})
    assert policy.message.max_seqs == 2
    with pytest.raises(InvalidRequestError, match=r"toy\.tp cannot be changed"):
        engine.policy.update_live({"tp": 1})
    with pytest.raises(InvalidRequestError) as info:
        registry.make_policy({"toy": {"tp": 3}}, 2)
    assert info.value.field == "policy.toy"


def test_the_router_takes_the_toys_planner_and_controller_from_its_spec(toy: PolicySpec) -> None:
    from tests.fixtures.toy_policy.router import ToyController

    policy = checks.with_defaults(parse_policy({"toy": {"maxPromptTokens": 3}}), 1)
    stats = worker_pb2.WorkerStats(policy=policy)
    planning = RequestPlanning()
    planning.plan_into(stats, worker_pb2.WorkerGenerateRequest(prompt_token_ids=[1, 2]), 8)
    with pytest.raises(ValueError, match="exceeds maxPromptTokens"):
        planning.plan_into(stats, worker_pb2.WorkerGenerateRequest(prompt_token_ids=[1] * 5), 8)
    control = PolicyControl()
    assert control.decide(stats) is None
    assert isinstance(control.controller, ToyController) and control.controller.polls == 1
    assert ("toy.max_seqs", 2.0) in list(_numeric_fields(policy))  # its gauges


def _toy_env(tmp_path: Path, how: str) -> dict[str, str]:
    """The environment of a process that learns of the toy by ``how``: GEARSHIFT_POLICY_PACKAGES,
    or an installed distribution's entry point (a dist-info on the path, as pip leaves it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEARSHIFT_")}
    path = [str(REPO)]
    if how == "env":
        env["GEARSHIFT_POLICY_PACKAGES"] = TOY
    else:
        site = tmp_path / "site"
        dist = site / "gearshift_toy_policy-0.1.dist-info"
        dist.mkdir(parents=True)
        (dist / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: gearshift-toy-policy\nVersion: 0.1\n"
        )
        (dist / "entry_points.txt").write_text(f"[gearshift.policies]\ntoy = {TOY}.spec:SPEC\n")
        path.insert(0, str(site))
    env["PYTHONPATH"] = os.pathsep.join([*path, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _gearshift(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gearshift.operator.cli", *argv],
        capture_output=True, text=True, timeout=300, env=env, cwd=REPO,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("how", ["env", "entry-point"])
def test_gearshift_generate_and_worker_take_a_toy_policy_config(
    how: str, tmp_path: Path, tiny_checkpoint: Any, smollm2_path: Path
) -> None:
    from tests.worker.helpers import random_model_with_smollm2_tokenizer

    model = random_model_with_smollm2_tokenizer(tmp_path / "model", smollm2_path)
    env = _toy_env(tmp_path, how)
    common = ["generate", "--model", str(model), "--dtype", "float32", "--prompt", "The sky is",
              "--max-tokens", "8", "--ignore-eos"]  # fmt: skip
    static = _gearshift(env, *common)
    assert static.returncode == 0, static.stderr
    toy = _gearshift(env, *common, "--policy-config", '{"toy": {"tp": 2, "maxSeqs": 1}}')
    assert toy.returncode == 0, toy.stderr
    assert toy.stdout == static.stdout and static.stdout.strip()
    refused = _gearshift(env, "worker", "--model", str(model), "--port", "0",
                         "--policy-config", '{"toy": {"tp": 3}}')  # fmt: skip
    assert refused.returncode == 2, refused.stderr
    assert "policy.toy: tp must equal the group's GPUs" in refused.stderr


@pytest.mark.slow
def test_gearshift_serve_runs_a_toy_group_and_its_router_planner(
    tmp_path: Path, smollm2_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from openai import APIStatusError, OpenAI

    from tests.e2e.serve_process import ServeProcess
    from tests.worker.helpers import random_model_with_smollm2_tokenizer

    model = random_model_with_smollm2_tokenizer(tmp_path / "model", smollm2_path)
    # The serve process, its router and its workers find the toy through its entry point.
    monkeypatch.setenv("PYTHONPATH", _toy_env(tmp_path, "entry-point")["PYTHONPATH"])
    texts = {}
    for name, policy in (
        ("static", '{"static": {}}'),
        ("toy", '{"toy": {"tp": 2, "maxPromptTokens": 16}}'),
    ):
        (tmp_path / name).mkdir()
        with ServeProcess(
            tmp_path / name, "--model", str(model), "--dtype", "float32",
            "--policy-config", policy, start_timeout=300,
        ) as proc:  # fmt: skip
            client = OpenAI(base_url=f"{proc.url}/v1", api_key="none", timeout=120, max_retries=0)
            served = client.models.list().data[0].id
            reply = client.completions.create(
                model=served, prompt="The sky is", max_tokens=8, temperature=0.0
            )
            texts[name] = reply.choices[0].text
            if name == "toy":
                with pytest.raises(APIStatusError) as info:
                    client.completions.create(model=served, prompt="word " * 40, max_tokens=4)
                assert info.value.status_code == 503
                assert "exceeds maxPromptTokens (16)" in str(info.value)
            assert proc.stop() == 0, proc.tail()
            assert proc.survivors() == []
    assert texts["toy"] == texts["static"] and texts["toy"]
