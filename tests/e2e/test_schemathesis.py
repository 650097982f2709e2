"""Schemathesis against the served /openapi.json of `gearshift serve`: generated valid and
invalid bodies for every operation must never get a 5xx, and every status and content type
answered must be the ones the schema documents (issue 11: 400, not 422).

Bounded for CI: a fixed seed (derandomized Hypothesis), a small example budget per operation,
and generation lengths clamped so that a valid request costs a few decode steps at most.
"""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    status_code_conformance,
)

from tests.e2e.conftest import API_KEY
from tests.e2e.serve_process import ServeProcess

pytestmark = pytest.mark.slow

EXAMPLES_PER_OPERATION = 30
# Clamped so that valid requests stay cheap; the values stay in range, so what is tested is
# what the schema allows, only shorter.
_CLAMP = {"max_tokens": 4, "max_completion_tokens": 4, "min_tokens": 2, "n": 2, "best_of": 2}


def _clamp(body: Any) -> None:
    if not isinstance(body, dict):
        return
    for name, most in _CLAMP.items():
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > most:
            body[name] = most
    if isinstance(body.get("best_of"), int) and isinstance(body.get("n"), int):
        body["best_of"] = max(body["best_of"], body["n"])


def _check(case: Any) -> None:
    _clamp(case.body)
    checks = [not_a_server_error, status_code_conformance, content_type_conformance]
    if case.meta is not None and case.meta.generation.mode == GenerationMode.NEGATIVE:
        checks.append(negative_data_rejection)
    case.call_and_validate(
        headers={"Authorization": f"Bearer {API_KEY}"}, checks=checks, timeout=60
    )


def fuzz(base_url: str, mode: GenerationMode, examples: int = EXAMPLES_PER_OPERATION) -> None:
    """Every operation of `base_url`'s /openapi.json, `examples` cases each, checked."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    for result in schema.get_all_operations():
        operation = result.ok()

        # One Hypothesis run per operation; derandomized: the same cases on every run.
        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=examples,
            derandomize=True,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def run(case: Any) -> None:
            _check(case)

        try:
            run()
        except Unsatisfiable:
            # An operation without inputs (GET /health) has no invalid request to make.
            assert mode == GenerationMode.NEGATIVE and operation.method == "get", operation


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_generated_requests_never_get_a_5xx_and_match_the_schema(
    serve: ServeProcess, mode: GenerationMode
) -> None:
    fuzz(serve.url, mode)
