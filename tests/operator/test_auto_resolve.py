"""`policy: auto` planned into a concrete policy (issue 16, item 4): the simulator's choice for one
group, refusals naming the field, the GPU from node labels, and re-planning only on new inputs."""

from __future__ import annotations

import copy
import datetime as dt
from pathlib import Path
from typing import Any

import pytest
import yaml
from google.protobuf import json_format

from gearshift.operator.reconcile import auto
from gearshift.operator.reconcile.reconciler import runnable, runnable_spec
from gearshift.operator.reconcile.spec import SpecError, parse
from gearshift.operator.sim import auto_policy, hardware, model_desc
from gearshift.operator.sim.planning import plan_deployment
from gearshift.v1 import policy_fields, policy_pb2
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.policies import checks
from gearshift.worker.policies.registry import make_policy

REPO = Path(__file__).resolve().parents[2]
NOW = dt.datetime(2026, 11, 24, tzinfo=dt.UTC)
H100_NODE = {"metadata": {"name": "gpu-1", "labels": {auto.GPU_LABEL: "NVIDIA-H100-80GB-HBM3"}}}
# One request at a time, short prompts, long answers: TP's decode wins (Shift §2).
CHAT = {"rate": 0.05, "prompt": {"fixed": 64}, "output": {"fixed": 200}}
# Long prompts at a high rate: SP's prefill wins the TTFT (Shift §2, Fig. 1).
LONG = {"rate": 20, "prompt": {"fixed": 8000}, "output": {"fixed": 16}}
SHORT = {"rate": 0.05, "prompt": {"fixed": 32}, "output": {"fixed": 8}}  # a quick plan


def _body(traffic: dict[str, Any] | None = None, **auto_fields: Any) -> dict[str, Any]:
    body = yaml.safe_load((REPO / "docs/examples/auto.yaml").read_text())
    body["metadata"].update(namespace="ns", uid="u", generation=1)
    a = body["spec"]["policy"]["auto"]
    a.pop("goodput")
    a["requests"] = 10
    # Every new plan is taken at once: these tests are about planning; the apply rules (margin,
    # cooldown, Recommend) have their own tests (test_auto_apply*.py).
    a["cooldownSeconds"] = 0
    a["margin"] = 0
    # The Shift paper's directions (TP for lone decodes, SP for long prompts at a high rate)
    # between static and Shift; SiDP joins by default (test_sidp_cost.py, the refusals below).
    a["policies"] = ["static", "shift"]
    a["traffic"] = copy.deepcopy(traffic or CHAT)
    a.update(auto_fields)
    return body


def _auto(body: dict[str, Any]) -> policy_pb2.AutoPolicy:
    return json_format.ParseDict(body["spec"]["policy"]["auto"], policy_pb2.AutoPolicy())


def test_traffic_decides_the_layout_and_the_choice_is_the_plans_recommendation() -> None:
    chat, _ = runnable(_body(CHAT), {}, [H100_NODE], NOW)
    long, chosen = runnable(_body(LONG), {}, [H100_NODE], NOW)
    assert json_format.MessageToDict(chat.policy) == {"static": {"tp": 8}}
    assert policy_fields.kind_of(long.policy) in ("shift", "static")
    assert long.policy.WhichOneof("kind") == "shift" or long.policy.static.sp == 8
    assert chosen is not None and chosen.planned and chosen.status["gpu"] == "H100"
    # The same simulation `gearshift plan` runs, over the layouts that fill the one group.
    model = auto_policy.model_of(_auto(_body(LONG)))
    traffic = auto_policy.traffic_of(_auto(_body(LONG)), auto_policy.GroupShape(8, 8, 1))
    # The body's policies (static, shift): with Tetris in too, its 4p1x4 ties Shift 8 on p99 TTFT
    # within the measured error and wins on TPOT (issue 30's tie rule).
    report = plan_deployment(
        model,
        hardware.preset("8xH100"),
        traffic,
        kinds={"static", "shift"},
        only=lambda c: c.gpus_per_group == 8,
    )
    assert report.recommended is not None
    assert chosen.status["choice"] == report.recommended.candidate.name
    assert {c["name"] for c in chosen.status["considered"]} == {"tp8", "sp8", "pp8", "shift8"}
    # Shift won: its threshold (a live field) is the simulated best of the tried switch points,
    # and the predicted figures are that threshold's.
    threshold = chosen.status["policy"]["shift"]["threshold"]
    assert (
        threshold in auto_policy.SHIFT_THRESHOLDS
        and f"threshold {threshold}" in (chosen.status["reason"])
    )
    assert chosen.status["predicted"]["ttftP99Seconds"] > 0


def test_a_shift_threshold_follows_the_traffic() -> None:
    chat, _ = runnable(_body(CHAT, policies=["shift"]), {}, [H100_NODE], NOW)
    medium = {"rate": 30, "prompt": {"fixed": 300}, "output": {"fixed": 100}}
    busy, _ = runnable(_body(medium, policies=["shift"]), {}, [H100_NODE], NOW)
    # 64-token prefills run best on the TP gear; 300-token steps at 30 req/s too (Alg. 3).
    assert (chat.policy.shift.threshold, busy.policy.shift.threshold) == (256, 1024)
    assert (
        policy_fields.non_live_changes(
            checks.with_defaults(chat.policy, 8), checks.with_defaults(busy.policy, 8)
        )
        == []
    )


def test_each_group_is_planned_for_its_share_of_the_traffic() -> None:
    shape = auto_policy.GroupShape(gpus=2, gpus_per_node=2, replicas=4)
    traffic = auto_policy.traffic_of(_auto(_body(LONG)), shape)
    assert traffic.rate == pytest.approx(5.0)
    choice = auto_policy.choose(_auto(_body(LONG)), "H100", shape)
    assert choice.report.traffic.rate == pytest.approx(5.0)
    assert all(r.candidate.gpus_per_group == 2 for r in choice.report.results)


def test_the_stored_choice_is_reused_until_an_input_changes() -> None:
    body = _body(SHORT)
    spec, first = runnable(body, {}, [H100_NODE], NOW)
    assert first is not None and first.planned
    previous = {"auto": first.status}
    again, second = runnable(body, previous, [H100_NODE], NOW + dt.timedelta(hours=1))
    assert second is not None and not second.planned and second.status == first.status
    assert again.policy == spec.policy
    # The stored policy is what runs, so a changed input must change the digest.
    changes = [
        _body({"rate": 0.1, "prompt": {"fixed": 64}, "output": {"fixed": 20}}),
        _body(SHORT, goodput="ttft:500"),
        _body(SHORT, gpu="H200"),
        _body(SHORT, policies=["static"]),
        _body(SHORT, policies=["static", "shift", "sidp"]),
    ]
    more_groups = _body(SHORT)
    more_groups["spec"]["replicas"] = 2
    other_shape = _body(SHORT)
    other_shape["spec"]["group"]["gpusPerNode"] = 4
    for changed in [*changes, more_groups, other_shape]:
        _, third = runnable(changed, previous, [H100_NODE], NOW)
        assert third is not None and third.planned
        assert third.status["inputs"] != first.status["inputs"]
    # The same inputs with the GPU read from other nodes: a new GPU plans again.
    h200 = {"metadata": {"name": "n", "labels": {auto.GPU_LABEL: "NVIDIA-H200"}}}
    anywhere = _body(SHORT)
    del anywhere["spec"]["scheduling"]
    _, fourth = runnable(anywhere, previous, [h200], NOW)
    assert fourth is not None and fourth.planned and fourth.status["gpu"] == "H200"


@pytest.mark.parametrize(
    ("change", "field", "text"),
    [
        ({"model": None}, "spec.policy.auto.model", "required"),
        ({"traffic": None}, "spec.policy.auto.traffic", "required"),
        ({"gpu": "A100"}, "spec.policy.auto.gpu", "'A100' is not a device"),
        ({"policies": ["bogus"]}, "spec.policy.auto.policies", "not policy kinds"),
        ({"policies": ["auto"]}, "spec.policy.auto.policies", "not policy kinds"),
        ({"goodput": "ttft:fast"}, "spec.policy.auto.goodput", "ttft must be a number"),
        ({"model": {"hiddenSize": 4096}}, "spec.policy.auto.model", "missing"),
        (
            {"traffic": {"rate": 1, "prompt": {"preset": "wiki"}}},
            "spec.policy.auto.traffic.prompt.preset",
            "'wiki'",
        ),
        (
            {"traffic": {"rate": 1, "prompt": {"preset": "arxiv", "fixed": 10}}},
            "spec.policy.auto.traffic.prompt",
            "set one of",
        ),
        ({"traffic": {"rate": 0}}, "spec.policy.auto.traffic.rate", "> 0"),
        # Llama-3.1-8B in fp32 with a 32k context on one L4: no layout fits.
        ({"gpu": "L4", "model": "fp32"}, "spec.policy.auto", "no layout"),
    ],
)
def test_refusals_name_the_field(change: dict[str, Any], field: str, text: str) -> None:
    body = _body(CHAT)
    a = body["spec"]["policy"]["auto"]
    for key, value in change.items():
        if value is None:
            a.pop(key)
        elif value == "fp32":
            a["model"]["torchDtype"] = "float32"
        else:
            a[key] = value
    if change.get("gpu") == "L4":
        body["spec"]["group"]["gpusPerNode"] = 1
    with pytest.raises(SpecError) as err:
        runnable_spec(body, [H100_NODE])
    assert err.value.field == field, err.value
    assert str(err.value).startswith(f"{field}: ") and text in str(err.value)


def test_the_gpu_comes_from_the_selected_nodes_labels() -> None:
    def node(name: str, product: str, **labels: str) -> dict[str, Any]:
        return {"metadata": {"name": name, "labels": {auto.GPU_LABEL: product, **labels}}}

    pool = [node("a", "NVIDIA-H100-80GB-HBM3", pool="big"), node("b", "NVIDIA-L4", pool="small")]
    assert auto.gpu_from_nodes(pool, {"pool": "big"}) == "H100"
    assert auto.gpu_from_nodes(pool, {"pool": "small"}) == "L4"
    for nodes, selector, text in [
        (pool, {}, "different GPUs"),
        (pool, {"pool": "none"}, "no node matching"),
        ([{"metadata": {"name": "cpu"}}], {}, "no node carries"),
        ([node("c", "NVIDIA-L40S")], {}, "not a device the planner describes"),
    ]:
        with pytest.raises(SpecError) as err:
            auto.gpu_from_nodes(nodes, selector)
        assert err.value.field == "spec.policy.auto.gpu" and text in str(err.value)


@pytest.mark.slow
def test_the_example_resolves_to_a_layout_the_engine_runs() -> None:
    body = yaml.safe_load((REPO / "docs/examples/auto.yaml").read_text())
    body["metadata"].update(namespace="ns", uid="u", generation=1)
    spec, chosen = runnable(body, {}, [H100_NODE], NOW)
    assert chosen is not None and policy_fields.kind_of(spec.policy) != "auto"
    # Without auto.policies every simulated kind competes for the group's 8 GPUs.
    assert {c["name"] for c in chosen.status["considered"]} == {
        *("tp8", "sp8", "pp8", "shift8"),
        *("sidp1x8", "sidp2x4", "sidp4x2", "seesaw8"),
        *(f"tetris{8 - d * t}p{d}x{t}" for t in (1, 2, 4) for d in range(1, 8) if 8 - d * t >= 2),
    }
    assert checks.layout_errors(spec.policy, spec.group.ranks) == []
    assert chosen.status["predicted"]["kvTokens"] > 0
    assert "auto chose" in auto.event_message(chosen.status)


def test_workers_and_engine_vllm_refuse_auto_naming_it() -> None:
    with pytest.raises(InvalidRequestError) as err:
        make_policy({"auto": {}})
    assert err.value.field == "policy.auto" and "planned by the operator" in err.value.message
    body = _body(CHAT)
    body["spec"]["engine"] = "vllm"
    body["spec"]["images"]["vllm"] = "vllm/vllm-openai"
    with pytest.raises(SpecError) as spec_err:
        parse(body)
    assert spec_err.value.field == "spec.policy"


def test_model_shape_reads_like_config_json() -> None:
    a = _auto(_body(CHAT))
    m = auto_policy.model_of(a)
    ref = model_desc.from_config(
        {
            "num_hidden_layers": 32,
            "hidden_size": 4096,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "intermediate_size": 14336,
            "vocab_size": 128256,
        }
    )
    assert (m.layers, m.hidden, m.heads, m.kv_heads, m.ffn, m.vocab, m.dtype) == (
        ref.layers,
        ref.hidden,
        ref.heads,
        ref.kv_heads,
        ref.ffn,
        ref.vocab,
        "bfloat16",
    )


def test_a_model_with_its_own_head_dim_is_priced_with_it() -> None:
    """Qwen3-style: 16 heads of 128 over hidden 1024 (headDim in the CRD, head_dim in
    config.json); without it the planner would take 64-wide heads and half the KV."""
    body = _body(CHAT)
    body["spec"]["policy"]["auto"]["model"].update(
        {"hiddenSize": 1024, "numAttentionHeads": 16, "numKeyValueHeads": 8, "headDim": 128}
    )
    m = auto_policy.model_of(_auto(body))
    assert (m.head_dim, m.q_dim) == (128, 2048)
    del body["spec"]["policy"]["auto"]["model"]["headDim"]
    assert auto_policy.model_of(_auto(body)).head_dim == 64
