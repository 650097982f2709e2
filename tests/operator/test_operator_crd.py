"""The CRD: generated from the proto, valid, takes every example, rejects bad resources by field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from crd_validation import validate, version_schema
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from gearshift.operator.reconcile import crd as crd_module
from gearshift.operator.reconcile import crd_schema
from gearshift.v1 import policy_fields, policy_pb2

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "inferencedeployments.gearshift.dev.yaml"
CHART_CRD_PATH = REPO / "charts" / "gearshift" / "crds" / "inferencedeployments.gearshift.dev.yaml"
EXAMPLES = sorted((REPO / "docs" / "examples").glob("*.yaml"))
K8S_VERSION = kubernetes_validate.utils.latest_version()


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    return dict(yaml.safe_load(CRD_PATH.read_text()))


@pytest.fixture(scope="module")
def comments() -> dict[str, str]:
    return crd_schema.proto_comments()


def _example(name: str) -> dict[str, Any]:
    body = dict(yaml.safe_load((REPO / "docs" / "examples" / f"{name}.yaml").read_text()))
    body["metadata"]["namespace"] = "default"
    return body


def test_committed_crd_is_what_make_crd_generates_and_the_chart_ships_the_same_file(
    comments: dict[str, str],
) -> None:
    assert CRD_PATH.read_text() == crd_module.render(comments), "run `make crd`"
    assert CHART_CRD_PATH.read_bytes() == CRD_PATH.read_bytes(), "run `make crd`"


def test_crd_passes_kubernetes_validate(crd: dict[str, Any]) -> None:
    kubernetes_validate.validate(crd, K8S_VERSION, strict=True)
    version = crd["spec"]["versions"][0]
    assert version["subresources"]["scale"]["labelSelectorPath"] == ".status.selector"
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Policy",
        "Gear",
        "Ready",
        "Age",
    ]
    assert crd["spec"]["names"]["shortNames"] == ["infd"]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_validates_against_the_schema_and_cel_rules(
    crd: dict[str, Any], path: Path
) -> None:
    assert validate(crd, yaml.safe_load(path.read_text())) == []


def test_every_policy_has_an_example() -> None:
    kinds = {next(iter(yaml.safe_load(p.read_text())["spec"]["policy"])) for p in EXAMPLES}
    assert kinds == set(policy_fields.POLICY_KINDS)


def _mutate(body: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    *parents, leaf = path.split(".")
    target = body
    for p in parents:
        target = target.setdefault(p, {})
    if value is _DELETE:
        target.pop(leaf, None)
    else:
        target[leaf] = value
    return body


_DELETE = object()

INVALID = [
    # (example, field path, new value, text the error must contain)
    ("shift", "spec.replicas", "two", "spec.replicas"),
    ("shift", "spec.replicas", -1, "spec.replicas"),
    ("shift", "spec.policy.shift.sp", 3, "policy.shift: sp × tp must equal"),
    ("shift", "spec.policy.shift.threshold", "high", "spec.policy.shift.threshold"),
    ("shift", "spec.policy.foo", {}, "spec.policy"),
    ("shift", "spec.policy.static", {"tp": 8}, "spec.policy: set exactly one"),
    ("shift", "spec.policy.shift.gear", 2, "spec.policy.shift"),
    ("shift", "spec.model.source", "s3://bucket/model", "spec.model.source"),
    ("shift", "spec.engine", "vllm", "engine: vllm runs only the static policy"),
    ("static", "spec.policy.static.pp", 4, "policy.static: tp × pp × sp × dp must equal"),
    ("static", "spec.policy.static.dp", 2, "policy.static"),
    ("static-vllm", "spec.images.vllm", _DELETE, "images.vllm: required"),
    ("shift", "spec.images.worker", _DELETE, "images.worker: required"),
    ("seesaw", "spec.policy.seesaw.decode.tp", 3, "policy.seesaw.decode"),
    (
        "seesaw",
        "spec.policy.seesaw.switchToPrefillAtHostUsage",
        1,
        "switchToPrefillAtHostUsage must be below",
    ),
    ("sidp", "spec.policy.sidp.mode", "SOMETIMES", "spec.policy.sidp.mode"),
    ("sidp", "spec.policy.sidp.wasEnterBatchSize", 16, "wasEnterBatchSize must be above"),
    ("sidp", "spec.policy.sidp.dp", 3, "policy.sidp: dp × tp must equal"),
    ("tetris", "spec.policy.tetris.decodeTp", 8, "policy.tetris"),
    ("tetris", "spec.policy.tetris.improvementRate", 1.5, "spec.policy.tetris.improvementRate"),
    ("auto", "spec.policy.auto.model", _DELETE, "model is required"),
    ("auto", "spec.policy.auto.traffic.rate", 0, "traffic.rate is required"),
    ("auto", "spec.policy.auto.traffic", _DELETE, "traffic.rate is required"),
    ("auto", "spec.policy.auto.traffic.prompt.fixed", 100, "set one of preset and fixed"),
    ("auto", "spec.policy.auto.requests", 5, "spec.policy.auto.requests"),
    ("auto", "spec.policy.auto.model.hiddenSize", 0, "spec.policy.auto.model.hiddenSize"),
    # Past a uint32's range: the API server would store what the operator cannot parse.
    ("auto", "spec.policy.auto.cooldownSeconds", 5_000_000_000, "auto.cooldownSeconds"),
    ("shift", "spec.policy.shift.threshold", 2**32, "spec.policy.shift.threshold"),
    ("shift", "metadata.name", "x" * 41, "metadata.name: at most 40"),
    ("shift", "spec.restartPolicy", {"backoffSeconds": 600}, "maxBackoffSeconds must be at least"),
    ("static", "spec.router", {"protectMetrics": True}, "router.protectMetrics: needs"),
    ("static", "spec.router.drainTimeoutSeconds", -1, "spec.router.drainTimeoutSeconds"),
    ("static", "spec.model.attentionBackend", "flash", "spec.model.attentionBackend"),
    ("static-vllm", "spec.model.attentionBackend", "triton", "engine vllm picks its own"),
    # Issue 31: reserved env names, revisions that are paths.
    (
        "static",
        "spec.group.env",
        [{"name": "GEARSHIFT_CONTROL_TOKEN_FILE", "value": "/dev/null"}],
        "spec.group.env[0]: group.env: names the operator sets",
    ),
    ("static", "spec.group.env", [{"name": "VLLM_API_KEY", "value": ""}], "group.env"),
    ("static", "spec.group.env", [{"value": "x"}], "spec.group.env.0"),
    ("shift", "spec.model.revision", "../../etc", "spec.model.revision"),
    ("shift", "spec.model.revision", "refs/pr/1", "spec.model.revision"),
    ("shift", "spec.model.revision", "v1..2", "model.revision: must be a commit sha, tag"),
    ("shift", "spec.model.revision", "main;rm", "spec.model.revision"),
]


@pytest.mark.parametrize(
    ("example", "path", "value", "expected"), INVALID, ids=[f"{e}:{p}" for e, p, _, _ in INVALID]
)
def test_invalid_resources_are_rejected_naming_the_field(
    crd: dict[str, Any], example: str, path: str, value: Any, expected: str
) -> None:
    errors = validate(crd, _mutate(_example(example), path, value))
    assert any(expected in e for e in errors), errors


def _walk_agreement(desc: Descriptor, schema: dict[str, Any], where: str) -> None:
    props = schema["properties"]
    assert set(props) == {f.json_name for f in desc.fields}, where
    for f in desc.fields:
        sub = props[f.json_name]
        if f.is_repeated:
            assert sub["type"] == "array", f"{where}.{f.json_name}"
            sub = sub["items"]
        expected = {
            FieldDescriptor.TYPE_MESSAGE: "object",
            FieldDescriptor.TYPE_ENUM: "string",
            FieldDescriptor.TYPE_BOOL: "boolean",
            FieldDescriptor.TYPE_FLOAT: "number",
            FieldDescriptor.TYPE_DOUBLE: "number",
            FieldDescriptor.TYPE_STRING: "string",
        }.get(f.type, "integer")
        assert sub["type"] == expected, f"{where}.{f.json_name}"
        if f.type == FieldDescriptor.TYPE_ENUM:
            assert set(sub["enum"]) == {v.name for v in f.enum_type.values if v.number}
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            _walk_agreement(f.message_type, sub, f"{where}.{f.json_name}")


def test_crd_policy_schema_and_proto_policy_agree_field_by_field(crd: dict[str, Any]) -> None:
    policy = version_schema(crd)["properties"]["spec"]["properties"]["policy"]
    # Every kind is a property holding its own message; the oneof's packed member (a policy
    # package's kind) is not a field users write.
    assert set(policy["properties"]) == set(policy_fields.POLICY_KINDS)
    for kind in policy_fields.POLICY_KINDS:
        field = policy_pb2.Policy.DESCRIPTOR.fields_by_name[kind]
        _walk_agreement(field.message_type, policy["properties"][kind], f"spec.policy.{kind}")
    threshold = policy["properties"]["shift"]["properties"]["threshold"]
    assert "Default 256" in threshold["description"] and "Live" in threshold["description"]
