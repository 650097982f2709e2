"""Issue 10's OpenAI/vLLM fields through the official `openai` client against `gearshift serve`
(SmolLM2): n and best_of, logit_bias, allowed_token_ids, bad_words, request_id, structured
outputs and tool calls, whole and streamed."""

from __future__ import annotations

import json
from typing import Any

import grpc
import httpx
import jsonschema
import openai
import pytest

from gearshift.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.e2e.conftest import API_KEY
from tests.e2e.serve_process import ServeProcess, wait_for

PROMPT = "The capital of France is"
BF16_NOISE = 0.15  # a 3-token logprob sum, batch of three vs batch of one
CHAT = [{"role": "user", "content": "Give me a person as JSON."}]
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def client(serve: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{serve.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _greedy(client: openai.OpenAI, **kw: Any) -> Any:
    kw = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **kw}
    return client.completions.create(**kw)


def test_n_choices_have_distinct_indices_and_seeded_samples_differ(client: openai.OpenAI) -> None:
    out = _greedy(client, n=3, extra_body={"seed": 7}, temperature=None)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage is not None and out.usage.completion_tokens == 12
    again = _greedy(client, n=3, extra_body={"seed": 7}, temperature=None)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seed + index
    assert len({c.text for c in out.choices}) > 1


def test_n_streams_every_index_and_each_matches_its_greedy_text(client: openai.OpenAI) -> None:
    greedy = _greedy(client).choices[0].text
    texts: dict[int, str] = {}
    for chunk in client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=4, temperature=0, n=2, stream=True
    ):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {0: greedy, 1: greedy}


def test_chat_n_and_best_of_keep_the_n_most_likely(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=3, n=2, seed=1)
    assert sorted(c.index for c in chat.choices) == [0, 1]
    best = client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=3, n=1, best_of=3, seed=3, logprobs=0
    )
    assert len(best.choices) == 1
    # The kept choice is the most likely of the three sampled with those seeds (seed + index).
    # Alone, each runs in a batch of one instead of three, so its bf16 logprobs differ by a few
    # hundredths: a runner-up within that noise may be the one kept.
    picked = sum(best.choices[0].logprobs.token_logprobs)
    alone = [
        _greedy(client, temperature=None, seed=3 + i, logprobs=0, max_tokens=3).choices[0]
        for i in range(3)
    ]
    each = {c.text: sum(c.logprobs.token_logprobs) for c in alone}
    top = max(each.values())
    likely = {text for text, total in each.items() if total >= top - BF16_NOISE}
    assert best.choices[0].text in likely, (best.choices[0].text, each)
    assert picked == pytest.approx(each[best.choices[0].text], abs=BF16_NOISE)


def test_logit_bias_banning_the_greedy_token_changes_it(
    client: openai.OpenAI, serve: ServeProcess
) -> None:
    first = _greedy(client, max_tokens=1).choices[0]
    token_id = httpx.post(
        f"{serve.url}/tokenize",
        json={"prompt": first.text, "add_special_tokens": False},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    ).json()["tokens"][0]
    banned = _greedy(client, max_tokens=1, logit_bias={str(token_id): -100}).choices[0]
    assert banned.text != first.text
    allowed = _greedy(client, max_tokens=2, extra_body={"allowed_token_ids": [token_id]})
    assert allowed.choices[0].text == first.text * 2


def test_bad_words_are_never_generated(client: openai.OpenAI) -> None:
    plain = _greedy(client, max_tokens=3).choices[0].text
    word = plain.split()[0]
    out = _greedy(client, max_tokens=3, extra_body={"bad_words": [word]}).choices[0].text
    assert word not in out


def test_request_id_is_the_response_id_and_a_duplicate_in_flight_is_409(
    client: openai.OpenAI,
) -> None:
    out = _greedy(client, extra_body={"request_id": "my-request-1"})
    assert out.id == "my-request-1"
    stream = client.completions.create(
        model="smollm2",
        prompt=PROMPT,
        max_tokens=64,
        stream=True,
        extra_body={"request_id": "busy-1", "ignore_eos": True},
    )
    next(iter(stream))
    with pytest.raises(openai.ConflictError):
        _greedy(client, extra_body={"request_id": "busy-1"})
    stream.close()

    def free_again() -> bool:
        try:
            return _greedy(client, extra_body={"request_id": "busy-1"}).id == "busy-1"
        except openai.ConflictError:
            return False

    wait_for(free_again, 30, "the request id is free once its client went away")


def test_json_schema_response_parses_and_validates(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    out = client.chat.completions.create(
        model="smollm2", messages=CHAT, max_tokens=60, temperature=0, response_format=fmt
    )
    jsonschema.validate(json.loads(out.choices[0].message.content or ""), PERSON)
    text = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="smollm2",
            messages=CHAT,
            max_tokens=60,
            temperature=0,
            response_format=fmt,
            stream=True,
        )
        if c.choices
    )
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize(
    ("extra", "check"),
    [
        ({"guided_choice": ["yes", "no"]}, lambda t: t in {"yes", "no"}),
        ({"guided_regex": r"[0-9]{4}"}, lambda t: len(t) == 4 and t.isdigit()),
        ({"structured_outputs": {"json_object": True}}, lambda t: isinstance(json.loads(t), dict)),
        # GBNF, as llama.cpp writes it (converted to Lark); Lark itself goes through as is.
        ({"guided_grammar": 'root ::= ("yes" | "no") "."'}, lambda t: t in {"yes.", "no."}),
        ({"guided_grammar": 'start: "x=" /[0-9]/'}, lambda t: len(t) == 3 and t[2].isdigit()),
    ],
)
def test_vllm_guided_fields_constrain_the_text(client: openai.OpenAI, extra: dict, check) -> None:
    out = client.completions.create(
        model="smollm2", prompt=PROMPT, max_tokens=40, temperature=0, extra_body=extra
    )
    assert check(out.choices[0].text), out.choices[0].text


def test_named_tool_choice_returns_a_call_with_valid_arguments(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "max_tokens": 60,
        "temperature": 0,
        "tools": [WEATHER_TOOL, TIME_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    msg = client.chat.completions.create(**kw).choices[0].message
    assert msg.tool_calls and msg.tool_calls[0].function.name == "get_weather"
    args = json.loads(msg.tool_calls[0].function.arguments)
    jsonschema.validate(args, WEATHER_TOOL["function"]["parameters"])
    calls: dict[int, dict[str, str]] = {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
    assert calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == args


def test_required_tool_choice_returns_tool_calls(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
        max_tokens=80,
        temperature=0,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice="required",
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls
    assert {c.function.name for c in choice.message.tool_calls} <= {"get_weather", "get_time"}


def test_unknown_fields_are_accepted_and_ignored(client: openai.OpenAI) -> None:
    out = _greedy(client, extra_body={"definitely_not_a_field": 1})
    assert out.choices[0].text == _greedy(client).choices[0].text


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model="smollm2",
            prompt=PROMPT,
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 4
    assert all(c.usage is not None and c.usage.prompt_tokens == 5 for c in chunks)


def test_echo_with_logprobs_scores_the_prompt_like_prompt_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="smollm2",
        prompt=PROMPT,
        max_tokens=2,
        temperature=0,
        echo=True,
        logprobs=2,
        extra_body={"prompt_logprobs": 2},
    )
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT)
    assert len(lp.tokens) == 5 + 2  # five prompt tokens, two generated
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    prompt_lp = choice.model_extra["prompt_logprobs"]
    assert prompt_lp[0] is None and len(prompt_lp) == 5
    # Both views of the prompt agree: the prompt token's own logprob at each position.
    for k in range(1, 5):
        position = prompt_lp[k]
        own = [v for v in position.values() if v["decoded_token"] == lp.tokens[k]]
        assert own and abs(own[0]["logprob"] - lp.token_logprobs[k]) < 1e-5
        assert len(position) <= 3 and {v["rank"] for v in position.values()} >= {1, 2} - {0}
    streamed = list(
        client.completions.create(
            model="smollm2",
            prompt=PROMPT,
            max_tokens=2,
            temperature=0,
            echo=True,
            logprobs=2,
            stream=True,
        )
    )
    first = streamed[0].choices[0]
    assert first.text.startswith(PROMPT) and first.logprobs.token_logprobs[0] is None
    assert first.logprobs.tokens == lp.tokens[:6]


def test_chat_prompt_logprobs_cover_the_templated_prompt(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="smollm2",
        messages=CHAT,
        max_tokens=1,
        temperature=0,
        extra_body={"prompt_logprobs": 0},
    )
    prompt_lp = out.model_extra["prompt_logprobs"]
    assert out.usage is not None and len(prompt_lp) == out.usage.prompt_tokens
    assert prompt_lp[0] is None and all(len(p) == 1 for p in prompt_lp[1:])


def test_a_list_of_prompts_gets_n_choices_each_in_vllm_order(client: openai.OpenAI) -> None:
    prompts = [PROMPT, "One, two, three,"]
    out = client.completions.create(
        model="smollm2", prompt=prompts, max_tokens=3, temperature=0, n=2
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    singles = [_greedy(client, prompt=p, max_tokens=3).choices[0].text for p in prompts]
    assert [c.text for c in out.choices] == [singles[0], singles[0], singles[1], singles[1]]
    assert out.usage is not None and out.usage.completion_tokens == 12
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(
        model="smollm2", prompt=prompts, max_tokens=3, temperature=0, stream=True
    ):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {0: singles[0], 1: singles[1]}


def test_grpc_honours_structured_outputs_logit_bias_and_prompt_logprobs(
    serve: ServeProcess,
) -> None:
    sampling = common_pb2.SamplingParams(
        max_tokens=8,
        temperature=0,
        prompt_logprobs=1,
        # SmolLM2's digits are ids 32..41: every one but "7" (39) is banned.
        logit_bias={t: -100.0 for t in range(32, 42) if t != 39},
        structured=common_pb2.StructuredOutput(regex="[0-9]{3}"),
    )
    with grpc.insecure_channel(serve.grpc_address) as channel:
        out = list(
            router_pb2_grpc.GenerationStub(channel).Generate(
                router_pb2.GenerateRequest(prompt=PROMPT, sampling=sampling),
                metadata=(("authorization", f"Bearer {API_KEY}"),),
                timeout=60,
            )
        )
    assert len(out) == 1
    assert out[0].text == "777"
    assert [lp.rank >= 1 for lp in out[0].prompt_logprobs] == [True] * 4
