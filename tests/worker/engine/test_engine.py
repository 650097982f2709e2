"""Engine behaviour: chunking, preemption, prefix caching, abort; bad input never leaks blocks."""

from __future__ import annotations

import pytest
import torch

from gearshift.worker.engine.sequence import FinishReason
from gearshift.worker.errors import InvalidRequestError, ModelLoadError
from gearshift.worker.sampling.params import InvalidSamplingParams, SamplingParams
from tests.worker.helpers import run_recording

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _prompts(n: int, length: int, vocab: int = 128, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length + 3 * i,), generator=g).tolist() for i in range(n)]


def test_chunked_prefill_gives_the_logits_of_unchunked(tiny_checkpoint, engine_factory):
    folder = tiny_checkpoint("llama3-scaled")
    prompts = _prompts(3, 37)
    requests = {0: [(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]}
    whole = run_recording(
        engine_factory(folder, skip_tokenizer_init=True, max_num_batched_tokens=512), requests
    )
    small = engine_factory(folder, skip_tokenizer_init=True, max_num_batched_tokens=7)
    chunked = run_recording(small, requests)
    assert max(max(plan.prefill_query_lens, default=0) for plan, _ in small.executor.records) <= 7
    for rid, rows in whole.items():
        assert [c for c, _ in rows] == [c for c, _ in chunked[rid]]
        for (_, a), (_, b) in zip(rows, chunked[rid], strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_preemption_and_recompute_give_the_same_greedy_tokens(tiny_checkpoint, engine_factory):
    folder = tiny_checkpoint("qwen2")
    prompts = _prompts(6, 20)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    roomy = engine_factory(folder, skip_tokenizer_init=True, block_size=4, record=False)
    # 40 blocks of 4 tokens cannot hold six 44-token sequences at once.
    cramped = engine_factory(
        folder,
        skip_tokenizer_init=True,
        block_size=4,
        max_model_len=64,
        record=False,
        kv_cache_bytes=_bytes_for_blocks(roomy, 40),
    )
    assert cramped.blocks.num_blocks == 40
    expected = roomy.generate(prompts, params)
    got = cramped.generate(prompts, params)
    assert cramped.scheduler.num_preemptions > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


def _bytes_for_blocks(engine, n: int) -> int:
    runner = engine.executor.inner if hasattr(engine.executor, "inner") else engine.executor
    k, _ = runner.kv_caches[0]
    per_block = 2 * len(runner.kv_caches) * k[0].numel() * k.element_size()
    return n * per_block


def test_prefix_cache_hits_give_the_logits_of_misses(tiny_checkpoint, engine_factory):
    folder = tiny_checkpoint("mistral")
    shared = _prompts(1, 29, seed=11)[0]
    first, second = [*shared, 5, 6, 7], [*shared, 9, 10]
    cached = engine_factory(folder, skip_tokenizer_init=True, block_size=4)
    cold = engine_factory(
        folder, skip_tokenizer_init=True, block_size=4, enable_prefix_caching=False
    )
    for engine in (cached, cold):
        engine.generate([first], GREEDY)
    hot_rows = run_recording(cached, {0: [("b", second, GREEDY)]})
    cold_rows = run_recording(cold, {0: [("b", second, GREEDY)]})
    # The second prompt's 7 full blocks of 4 shared tokens come from the cache.
    assert cached.executor.records[-len(hot_rows["b"])][0].prefill_query_lens == (len(second) - 28,)
    assert cold.executor.records[-len(cold_rows["b"])][0].prefill_query_lens == (len(second),)
    for (_, a), (_, b) in zip(hot_rows["b"], cold_rows["b"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_prefix_cache_hit_is_reported_in_outputs(tiny_checkpoint, engine_factory):
    engine = engine_factory(tiny_checkpoint("llama2-bias"), skip_tokenizer_init=True, block_size=4)
    prompt = _prompts(1, 30)[0]
    a, b = engine.generate([prompt, prompt], GREEDY)
    c = engine.generate([prompt], GREEDY)[0]
    assert a.num_cached_tokens == 0
    assert c.num_cached_tokens == 28  # last prompt token is always computed
    assert c.token_ids == a.token_ids == b.token_ids


def test_abort_frees_every_block_wherever_the_request_is(tiny_checkpoint, engine_factory):
    engine = engine_factory(
        tiny_checkpoint("llama2-bias"), skip_tokenizer_init=True, block_size=4, max_num_seqs=2
    )
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i, p in enumerate(_prompts(4, 15)):
        engine.add_request(f"r{i}", p, params)
    for _ in range(3):
        engine.step()
    assert engine.blocks.num_free_blocks < engine.blocks.num_blocks
    assert len(engine.scheduler.running) == 2 and len(engine.scheduler.waiting) == 2
    assert all(engine.abort_request(f"r{i}") for i in range(4))
    assert not engine.abort_request("r0")
    assert engine.blocks.leaked_blocks() == []
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert engine.step() == []


def test_bad_requests_are_refused_by_name_and_the_engine_keeps_serving(
    tiny_checkpoint, engine_factory
):
    engine = engine_factory(
        tiny_checkpoint("llama2-bias"), skip_tokenizer_init=True, max_model_len=64
    )
    engine.add_request("good", [1, 2, 3], GREEDY)
    engine.step()
    cases = [
        ("empty", [], GREEDY, "prompt"),
        ("long", list(range(64)), GREEDY, "prompt"),
        ("too-many", [1, 2, 3], SamplingParams(max_tokens=62), "max_tokens"),
        ("vocab", [1, 999], GREEDY, "prompt"),
        ("good", [1], GREEDY, "request_id"),
        ("text", "hello", GREEDY, "prompt"),  # no tokenizer in this engine
    ]
    for rid, prompt, params, field in cases:
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request(rid, prompt, params)
        assert info.value.field == field, rid
    for kwargs, field in (
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -5}, "top_k"),
    ):
        with pytest.raises(InvalidSamplingParams) as sinfo:
            SamplingParams(**kwargs)
        assert sinfo.value.field == field and field in str(sinfo.value)
    assert set(engine.requests) == {"good"}
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["good"]
    assert finished[0].finish_reason is FinishReason.LENGTH
    assert finished[0].num_output_tokens == GREEDY.max_tokens


def test_unknown_model_path_is_named(engine_factory, tmp_path):
    with pytest.raises(ModelLoadError, match="nowhere"):
        engine_factory(tmp_path / "nowhere")


def test_a_failed_forward_ends_its_requests_with_an_error_and_frees_them(
    tiny_checkpoint, engine_factory
):
    engine = engine_factory(tiny_checkpoint("llama2-bias"), skip_tokenizer_init=True)
    engine.add_request("x", [1, 2, 3], GREEDY)
    inner = engine.executor.inner

    class Broken:
        def submit(self, plan):
            raise RuntimeError("device fell over")

        def shutdown(self):
            inner.shutdown()

    engine.executor = Broken()
    (out,) = engine.step()
    assert (
        out.finished and out.finish_reason is FinishReason.ERROR and "device fell over" in out.error
    )
    engine.executor = inner
    assert engine.generate([[4, 5]], GREEDY)[0].finish_reason is FinishReason.LENGTH


@pytest.mark.slow
def test_streamed_deltas_add_up_to_the_generate_result(smollm2_path, engine_factory):
    engine = engine_factory(smollm2_path, record=False, max_model_len=256)
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Name two fruits."}])
    params = SamplingParams(temperature=0.0, max_tokens=20)
    whole = engine.generate([prompt], params)[0]
    engine.add_request("s", prompt, params)
    text, tokens = "", []
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.new_text
            tokens += out.new_token_ids
    assert tokens == whole.token_ids and text == whole.text and text


@pytest.mark.slow
def test_stop_strings_and_stop_tokens_end_generation_exactly(smollm2_path, engine_factory):
    engine = engine_factory(smollm2_path, record=False, max_model_len=256)
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Count from 1 to 10, comma separated."}]
    )
    free = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40))[0]
    assert "5" in free.text
    cut = free.text.index("5")
    stopped = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, stop=["5"]))[
        0
    ]
    assert stopped.text == free.text[:cut]
    assert stopped.finish_reason is FinishReason.STOP and stopped.stop_reason == "5"
    kept = engine.generate(
        [prompt],
        SamplingParams(temperature=0.0, max_tokens=40, stop=["5"], include_stop_str_in_output=True),
    )[0]
    assert kept.text == free.text[: cut + 1]
    token = free.token_ids[3]
    by_token = engine.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[token])
    )[0]
    assert by_token.token_ids == free.token_ids[:4] and by_token.stop_reason == token


@pytest.mark.slow
def test_same_seed_gives_the_same_sampled_tokens_in_any_batch(tiny_checkpoint, engine_factory):
    engine = engine_factory(tiny_checkpoint("qwen3"), skip_tokenizer_init=True, record=False)
    p = _prompts(3, 10)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    alone = engine.generate([p[0]], seeded)[0].token_ids
    crowd = engine.generate([p[1], p[0], p[2]], [other, seeded, other])[1].token_ids
    assert alone == crowd
