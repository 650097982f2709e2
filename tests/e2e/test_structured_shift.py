"""Structured outputs under the shift policy with SP 3: the grammar mask is the leader's, so it
holds whichever gear (base SP×TP or shift TP) runs the step."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.serve_process import ServeProcess

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "population": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["big", "old", "port"]}, "maxItems": 2},
    },
    "required": ["city", "population", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def shift_serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    tmp: Path = tmp_path_factory.mktemp("serve-shift")
    # Threshold 8: prefills (more tokens) run the base gear (Ulysses SP 3), decodes of up to
    # 8 sequences the shift gear (TP 3); one constrained request crosses both.
    args = ["--model", "smollm2", "--dtype", "bfloat16", "--policy", "shift", "--sp", "3"]
    args += ["--shift-threshold", "8", "--max-model-len", "512", "--kv-cache-bytes", str(32 << 20)]
    with ServeProcess(tmp, *args) as proc:
        yield proc


def _gear_steps(serve: ServeProcess) -> dict[str, float]:
    text = httpx.get(f"{serve.url}/metrics", timeout=10).text
    steps: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if family.name == "gearshift_gear_steps":
                gear = sample.labels["gear"]
                steps[gear] = steps.get(gear, 0.0) + sample.value
    return steps


def test_json_schema_holds_across_both_gears_for_every_choice(shift_serve: ServeProcess) -> None:
    client = openai.OpenAI(
        base_url=f"{shift_serve.url}/v1", api_key="-", max_retries=0, timeout=300
    )
    before = _gear_steps(shift_serve)
    out = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Describe a city as JSON."}],
        max_tokens=80,
        n=3,
        seed=11,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    for choice in out.choices:
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)
    after = _gear_steps(shift_serve)
    assert after.get("base", 0) > before.get("base", 0), after
    assert after.get("shift", 0) > before.get("shift", 0), after
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="smollm2",
            prompt="Pick a colour:",
            max_tokens=10,
            stream=True,
            extra_body={"guided_choice": ["crimson", "teal", "ochre"]},
        )
        if c.choices
    )
    assert text in {"crimson", "teal", "ochre"}
