"""``spec.policy.auto.profile`` (issue 30, item 1): the plan priced from a calibration profile in a
ConfigMap, as ``gearshift plan --profile`` prices it; refusals name the field; the profile's content
is a plan input. The kmock tests are in test_auto_profile_kmock.py."""

from __future__ import annotations

import copy
import datetime as dt
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from cpu_profile import DTYPE, H100_NAME, LAYOUTS, MODEL, as_measured_on
from google.protobuf import json_format

from gearshift.operator.reconcile import auto
from gearshift.operator.reconcile.reconciler import runnable
from gearshift.operator.reconcile.spec import SpecError, parse

REPO = Path(__file__).resolve().parents[2]
NOW = dt.datetime(2026, 11, 27, tzinfo=dt.UTC)
FIELD = "spec.policy.auto.profile"
TRAFFIC = {"rate": 2, "prompt": {"fixed": 64}, "output": {"fixed": 16}}


def _body(**auto_fields: Any) -> dict[str, Any]:
    body = yaml.safe_load((REPO / "docs/examples/auto.yaml").read_text())
    body["metadata"].update(namespace="ns", uid="u", generation=1)
    body["spec"]["group"] = {"nodes": 1, "gpusPerNode": 2}
    body["spec"]["model"]["dtype"] = DTYPE  # the profile's: it must have measured this dtype
    a = body["spec"]["policy"]["auto"]
    a.pop("goodput")
    a.update(model=dict(MODEL), gpu="H100", requests=20, traffic=copy.deepcopy(TRAFFIC))
    a.update(profile="h100-profile", cooldownSeconds=0, margin=0)
    a.update(auto_fields)
    return body


def _map(text: str | None) -> dict[str, Any]:
    return {
        "metadata": {"name": "h100-profile"},
        "data": {} if text is None else {"profile.json": text},
    }


def test_the_plan_is_priced_from_the_profile_and_names_it(cpu_profile: str) -> None:
    text = as_measured_on(cpu_profile, H100_NAME)
    spec, chosen = runnable(_body(), {}, None, NOW, _map(text))
    assert chosen is not None
    st = chosen.status
    assert st["profile"]["configMap"] == "h100-profile"
    assert (
        st["profile"]["describe"].startswith("profile of ")
        and "2x NVIDIA H100" in st["profile"]["describe"]
    )
    assert st["pricing"].startswith("the profile in ConfigMap h100-profile: profile of ")
    # Only the layouts the profile measured compete (the preset would price sp2 and shift2 too).
    assert {line["name"] for line in st["considered"]} == set(LAYOUTS)
    assert st["choice"] in LAYOUTS
    assert json_format.MessageToDict(spec.policy) == st["policy"]  # what the workers run
    assert "h100-profile" in chosen.event.message  # type: ignore[union-attr]
    # Without a profile the same spec is priced from the preset, and more layouts compete.
    body = _body()
    del body["spec"]["policy"]["auto"]["profile"]
    _, preset = runnable(body, {}, None, NOW)
    assert preset is not None and preset.status["pricing"].startswith("the H100 preset")
    assert "profile" not in preset.status
    assert {line["name"] for line in preset.status["considered"]} > set(LAYOUTS)


@pytest.mark.parametrize(
    ("device", "kind"), [(None, "cpu"), ("NVIDIA H200", "cuda"), ("NVIDIA H100 PCIe", "cuda")]
)
def test_a_profile_of_another_device_is_refused(
    cpu_profile: str, device: str | None, kind: str
) -> None:
    text = cpu_profile if device is None else as_measured_on(cpu_profile, device)
    with pytest.raises(
        SpecError, match=rf"^{FIELD}: .* was measured on .*\({kind}\), not on the group's GPU H100"
    ) as err:
        runnable(_body(), {}, None, NOW, _map(text))
    assert err.value.field == FIELD


def test_the_gpu_from_the_node_label_must_agree_too(cpu_profile: str) -> None:
    body = _body()
    del body["spec"]["policy"]["auto"]["gpu"]
    h200 = {"metadata": {"name": "n", "labels": {auto.GPU_LABEL: "NVIDIA-H200"}}}
    body["spec"]["scheduling"]["nodeSelector"] = {auto.GPU_LABEL: "NVIDIA-H200"}
    with pytest.raises(SpecError, match="not on the group's GPU H200") as err:
        runnable(body, {}, [h200], NOW, _map(as_measured_on(cpu_profile, H100_NAME)))
    assert err.value.field == FIELD


@pytest.mark.parametrize(
    ("config_map", "says"),
    [
        (None, "ConfigMap h100-profile not found in namespace ns"),
        (_map(None), "has no key profile.json"),
        (_map("{not json"), "key profile.json: not JSON"),
        (_map(json.dumps({"format": "gearshift.profile/0"})), r"profile\.json\.format: expected"),
    ],
    ids=["missing", "no-key", "not-json", "bad-format"],
)
def test_a_missing_or_malformed_profile_is_refused_naming_the_field(
    config_map: dict[str, Any] | None, says: str
) -> None:
    with pytest.raises(SpecError, match=says) as err:
        runnable(_body(), {}, None, NOW, config_map)
    assert err.value.field == FIELD and str(err.value).startswith(FIELD)


def test_a_profile_covering_no_candidate_is_refused(cpu_profile: str) -> None:
    data = json.loads(as_measured_on(cpu_profile, H100_NAME))
    data["layouts"] = {"one": {**data["layouts"]["tp2"], "policy": {"static": {}}}}
    with pytest.raises(SpecError, match=f"^{FIELD}: it covers none of the candidates") as err:
        runnable(_body(), {}, None, NOW, _map(json.dumps(data)))
    assert err.value.field == FIELD


def test_a_name_that_is_not_a_config_map_name_is_refused() -> None:
    with pytest.raises(SpecError, match=f"^{FIELD}: '../secrets' is not a ConfigMap name") as err:
        auto.profile_name(parse(_body(profile="../secrets")))
    assert err.value.field == FIELD


def test_the_profiles_content_is_a_plan_input(cpu_profile: str) -> None:
    spec = parse(_body())
    text = as_measured_on(cpu_profile, H100_NAME)
    gpu, key = auto.inputs(spec, None, text)
    assert auto.inputs(spec, None, text) == (gpu, key)  # the same content: the same plan
    changed = json.loads(text)
    changed["layouts"]["tp2"]["kv_blocks"] += 1
    assert auto.inputs(spec, None, json.dumps(changed))[1] != key


def _refusal(body: dict[str, Any], text: str) -> str:
    with pytest.raises(SpecError) as err:
        auto.inputs(parse(body), None, text)
    assert err.value.field == FIELD and str(err.value).startswith(f"{FIELD}: "), err.value
    return str(err.value)


def test_a_profile_of_another_model_is_refused_naming_both_sides(cpu_profile: str) -> None:
    text = as_measured_on(cpu_profile, H100_NAME)
    message = _refusal(_body(model={**MODEL, "numHiddenLayers": 3, "vocabSize": 32000}), text)
    assert "model_shape.num_hidden_layers 2 vs spec.policy.auto.model.numHiddenLayers 3" in (
        message
    )
    assert "model_shape.vocab_size 49152 vs spec.policy.auto.model.vocabSize 32000" in message
    assert "hidden_size" not in message  # only what differs
    # Neither a plan nor a plan's child prices from it.
    with pytest.raises(SpecError, match="numHiddenLayers 3"):
        runnable(_body(model={**MODEL, "numHiddenLayers": 3}), {}, None, NOW, _map(text))


def test_a_profile_measured_in_another_dtype_is_refused(cpu_profile: str) -> None:
    text = as_measured_on(cpu_profile, H100_NAME)
    body = _body()
    body["spec"]["model"]["dtype"] = "bfloat16"  # the profile ran float32
    assert "dtype float32 vs spec.model.dtype bfloat16" in _refusal(body, text)
    # dtype auto: the checkpoint's, as spec.policy.auto.model.torchDtype declares it.
    body["spec"]["model"]["dtype"] = "auto"
    assert auto.inputs(parse(body), None, text)[0] == "H100"
    del body["spec"]["policy"]["auto"]["model"]["torchDtype"]
    assert "dtype float32 vs spec.policy.auto.model.torchDtype (default bfloat16) bfloat16" in (
        _refusal(body, text)
    )


def test_the_planners_child_checks_the_dtype_too(cpu_profile: str) -> None:
    from dataclasses import replace

    from gearshift.operator.reconcile.auto_planner import Failed, Planned, run_plan

    text = as_measured_on(cpu_profile, H100_NAME)
    spec = parse(_body())
    request = auto.request(spec, "H100", text)
    assert request.dtype == DTYPE
    assert isinstance(run_plan(request), Planned)
    failed = run_plan(replace(request, dtype="float16"))
    assert isinstance(failed, Failed) and failed.field == FIELD
    assert "dtype float32 vs spec.model.dtype float16" in failed.message


def test_a_profile_written_before_the_shape_was_recorded_is_refused(cpu_profile: str) -> None:
    data = json.loads(as_measured_on(cpu_profile, H100_NAME))
    data["format"] = "gearshift.profile/1"
    del data["model_shape"]
    message = _refusal(_body(), json.dumps(data))
    assert "key profile.json.format: 'gearshift.profile/1'" in message
    assert "profile again with gearshift profile --layouts" in message
