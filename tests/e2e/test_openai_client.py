"""The official `openai` client, unmodified, against `gearshift serve` (2 groups, SmolLM2)."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.conftest import API_KEY
from tests.e2e.serve_process import ServeProcess

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(serve: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{serve.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["smollm2"]


def test_greedy_completion_has_text_and_exact_usage(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=6, temperature=0
    )
    choice = out.choices[0]
    assert "Paris" in choice.text
    assert choice.finish_reason == "length"
    assert out.usage is not None
    assert out.usage.completion_tokens == 6
    assert out.usage.prompt_tokens == 5
    assert out.usage.total_tokens == 11


def test_streamed_completion_matches_the_whole_one_token_per_chunk(client: openai.OpenAI) -> None:
    kw = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    whole = client.completions.create(**kw)
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) == 12  # one chunk per token
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_answers_and_stops_at_the_end_of_turn(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="smollm2", messages=CHAT, max_tokens=32, temperature=0
    )
    choice = out.choices[0]
    assert "Paris" in (choice.message.content or "")
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    assert out.usage is not None and 0 < out.usage.completion_tokens < 32


def test_streamed_chat_equals_non_streamed_and_counts_usage(client: openai.OpenAI) -> None:
    kw = {"model": "smollm2", "messages": CHAT, "temperature": 0, "max_completion_tokens": 20}
    whole = client.chat.completions.create(**kw)
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    usage = chunks[-1].usage
    assert usage is not None and whole.usage is not None
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_stop_string_cuts_the_text_there(client: openai.OpenAI) -> None:
    kw = {"model": "smollm2", "prompt": "1, 2, 3, 4, 5,", "max_tokens": 30, "temperature": 0}
    free = client.completions.create(**kw).choices[0].text
    assert " 8," in free  # the greedy continuation counts on
    out = client.completions.create(stop=[" 8"], **kw)
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == free[: free.index(" 8")]
    assert out.usage is not None and out.usage.completion_tokens < 30
    streamed = client.completions.create(stop=[" 8"], stream=True, **kw)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text


def test_same_seed_same_sample_other_seed_differs(client: openai.OpenAI) -> None:
    kw = {
        "model": "smollm2",
        "prompt": "My favourite animal is",
        "max_tokens": 16,
        "temperature": 1.0,
        "top_p": 0.95,
    }
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    others = {client.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)}
    assert a == b
    assert others - {a}


def test_logprobs_come_back_in_openai_format(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="smollm2", prompt="The sky is", max_tokens=3, temperature=0, logprobs=2
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == 3
    assert "".join(lp.tokens) == out.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs)
    chat = client.chat.completions.create(
        model="smollm2", messages=CHAT, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 3
    assert all(len(t.top_logprobs) == 2 for t in content)


def test_vllm_extra_sampling_fields_are_accepted(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model="smollm2",
        prompt="Hello",
        max_tokens=8,
        temperature=0.7,
        seed=3,
        extra_body={"top_k": 5, "min_p": 0.05, "ignore_eos": True, "repetition_penalty": 1.1},
    )
    assert out.usage is not None and out.usage.completion_tokens == 8
