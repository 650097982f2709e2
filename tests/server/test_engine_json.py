"""engine.json end to end: what the operator and `gearshift serve` write is what the worker's
settings read, and a key the worker does not know is refused, naming it."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from google.protobuf import json_format

from gearshift.operator.commands import serve
from gearshift.operator.reconcile import names, render_config, spec
from gearshift.v1 import policy_pb2
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.server.engine_json import EngineJson
from gearshift.worker.server.settings import add_worker_args, load_settings

REPO = Path(__file__).resolve().parents[2]


def _worker_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_worker_args(p)
    return p.parse_args(["--insecure-no-auth", *argv])  # settings only: no server starts


def _deployment(attention_backend: str | None = None, **spec_fields: Any) -> spec.DeploymentSpec:
    body = yaml.safe_load((REPO / "docs/examples/shift.yaml").read_text())
    body["metadata"] = {"name": "demo", "namespace": "ml"}
    body["spec"]["group"] = {"nodes": 1, "gpusPerNode": 2}
    body["spec"]["policy"] = {"shift": {"sp": 2, "tp": 1, "threshold": 100}}
    body["spec"]["model"] = {
        "source": "/models/x",
        "name": "demo-model",
        "dtype": "float32",
        "maxModelLen": 512,
    }
    if attention_backend is not None:
        body["spec"]["model"]["attentionBackend"] = attention_backend
    body["spec"].update(spec_fields)
    return spec.parse(body)


def test_the_rendered_config_map_reads_back_as_the_deployment_says(tmp_path: Path) -> None:
    deployment = _deployment()
    text = render_config.config_map(deployment, [0], "cluster.local")["data"]["engine.json"]
    path = tmp_path / "engine.json"
    path.write_text(text)
    settings = load_settings(_worker_args("--config", str(path)), env={})
    assert settings.model == "/models/x"
    assert settings.served_model_name == "demo-model"
    assert settings.engine.dtype == "float32"
    assert settings.engine.max_model_len == 512
    assert settings.ranks == 2
    assert settings.port == names.WORKER_GRPC_PORT
    assert settings.policy == deployment.full_policy
    # The typed document is the file, key for key.
    assert EngineJson.load(path).to_dict() == json.loads(text)


def test_serve_s_engine_json_reads_back_as_its_flags_say(tmp_path: Path) -> None:
    policy = policy_pb2.Policy()
    json_format.ParseDict({"static": {"tp": 2}}, policy)
    args = argparse.Namespace(name="local", dtype="bfloat16", max_model_len=None)
    path = tmp_path / "engine.json"
    path.write_text(serve.local_engine_json(args, "smollm2", "small", policy, 2).dumps())
    settings = load_settings(_worker_args("--config", str(path)), env={})
    assert (settings.model, settings.served_model_name, settings.ranks) == ("smollm2", "small", 2)
    assert (settings.engine.dtype, settings.engine.max_model_len) == ("bfloat16", None)
    assert settings.policy.static.tp == 2
    assert settings.port == 50051  # no ports in serve's file: the default


def _load(tmp_path: Path, data: Any) -> None:
    path = tmp_path / "engine.json"
    path.write_text(json.dumps(data))
    load_settings(_worker_args("--config", str(path)), env={})


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda d: d.update(quantization="fp8"), "unknown key quantization"),
        (lambda d: d["model"].update(maxModelLength=4), "unknown key model.maxModelLength"),
        (lambda d: d["group"].update(ranks="2"), 'group.ranks: expected an integer, got "2"'),
        (lambda d: d["model"].update(maxModelLen=True), "model.maxModelLen: expected an integer"),
        (lambda d: d.update(model=["x"]), "model: expected an object"),
        (lambda d: d["group"].update(ranks=3), "group.ranks must be nodes × gpusPerNode"),
        (lambda d: d.update(engine="vllm"), "engine 'vllm' is not served by `gearshift worker`"),
    ],
)
def test_a_key_or_value_the_worker_cannot_honour_is_refused_by_name(
    tmp_path: Path, change: Any, words: str
) -> None:
    data = render_config.engine_config(_deployment())
    change(data)
    with pytest.raises(InvalidRequestError, match=re.escape(words)):
        _load(tmp_path, data)


def test_no_config_and_an_empty_one_mean_the_same_defaults(tmp_path: Path) -> None:
    path = tmp_path / "engine.json"
    path.write_text("{}")
    with_file = load_settings(_worker_args("--config", str(path)), env={})
    without = load_settings(_worker_args(), env={})
    assert with_file == without
    assert (without.model, without.ranks, without.port) == ("smollm2", 1, 50051)


def _keys(text: str) -> set[str]:
    """Key paths of docs/operator.md's `{a, b: {c, d}}` notation."""
    out: set[str] = set()
    stack: list[str] = []
    last = ""
    for token in re.findall(r"[A-Za-z]+|[{}:,]", text):
        if token == "{":
            continue
        if token == "}":
            if stack:
                stack.pop()
        elif token == ":":
            stack.append(last)
        elif token != ",":
            last = token
            out.add(".".join([*stack, token]))
    return out


def test_docs_list_every_key_of_engine_json() -> None:
    doc = (REPO / "docs/operator.md").read_text()
    listed = re.search(r"\*\*engine\.json\*\*: `(\{.*?\})`", doc, re.S)
    assert listed is not None
    # attentionBackend is written only when not auto: set it so every key is written.
    written = render_config.engine_config(_deployment(attention_backend="torch"))

    def paths(d: dict[str, Any], prefix: str = "") -> set[str]:
        out = set()
        for k, v in d.items():
            out.add(prefix + k)
            if isinstance(v, dict) and k != "policy":
                out |= paths(v, f"{prefix}{k}.")
        return out

    assert _keys(listed.group(1)) == paths(written)


def test_an_auto_attention_backend_is_not_written_and_reads_back_as_auto(tmp_path: Path) -> None:
    assert "attentionBackend" not in render_config.engine_config(_deployment())["model"]
    chosen = render_config.engine_json(_deployment(attention_backend="torch"))
    path = tmp_path / "engine.json"
    path.write_text(chosen.dumps())
    assert EngineJson.load(path).model.attention_backend == "torch"
