"""SamplingParams: defaults, normalisation, and one typed error per invalid field."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from gearshift.worker.sampling import InvalidSamplingParams, SamplingParams

INVALID: list[tuple[str, Any]] = [
    ("n", 2),
    ("n", 0),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 1.5),
    ("max_tokens", True),
    ("min_tokens", -1),
    ("temperature", -1.0),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "hot"),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", math.nan),
    ("top_k", -2),
    ("top_k", 2.5),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("min_p", math.nan),
    ("seed", 1.5),
    ("seed", 2**64),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.1),
    ("presence_penalty", math.inf),
    ("frequency_penalty", 3.0),
    ("frequency_penalty", math.nan),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf),
    ("stop", [""]),
    ("stop", ["ok", 3]),
    ("stop", None),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["2"]),
    ("logprobs", -1),
    ("logprobs", 21),
    ("ignore_eos", "yes"),
    ("include_stop_str_in_output", 1),
    ("skip_special_tokens", None),
]


@pytest.mark.parametrize(("field", "value"), INVALID)
def test_invalid_value_raises_naming_its_field(field: str, value: Any) -> None:
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field
    assert field in str(info.value)
    assert isinstance(info.value, ValueError)


def test_message_says_the_rule_and_the_value() -> None:
    with pytest.raises(InvalidSamplingParams, match=r"temperature must be >= 0, got -1.0"):
        SamplingParams(temperature=-1.0)


def test_min_tokens_above_max_tokens_is_rejected() -> None:
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert info.value.field == "min_tokens"
    assert SamplingParams(max_tokens=None, min_tokens=500).min_tokens == 500


def test_defaults_follow_vllm() -> None:
    params = SamplingParams()
    assert (params.n, params.max_tokens, params.temperature, params.top_p) == (1, 16, 1.0, 1.0)
    assert (params.top_k, params.min_p, params.seed, params.logprobs) == (-1, 0.0, None, None)
    assert params.skip_special_tokens and not params.ignore_eos
    assert not params.greedy and not params.has_penalties


def test_boundary_values_are_accepted() -> None:
    SamplingParams(temperature=0, top_p=1, top_k=0, min_p=1, logprobs=20, presence_penalty=-2)
    SamplingParams(top_k=1, frequency_penalty=2, repetition_penalty=1e-3, seed=-(2**63), logprobs=0)


def test_greedy_and_penalty_flags() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.01).greedy
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=0.5).has_penalties


def test_stop_lists_are_frozen_into_tuples() -> None:
    stop = ["a", "b"]
    params = SamplingParams(stop=stop, stop_token_ids=[7])
    stop.append("c")
    assert params.stop == ("a", "b") and params.stop_token_ids == (7,)
    assert SamplingParams(stop="END").stop == ("END",)
    hash(params)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.5  # type: ignore[misc]
