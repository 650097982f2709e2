"""prompt_logprobs: every prompt token's logprob from the second on, equal to a plain forward
of the same weights, whatever the chunking, the prefix cache or a neighbour in the batch."""

from __future__ import annotations

import torch

from gearshift.worker.engine.llm_engine import LLMEngine
from gearshift.worker.sampling.logprobs import TokenLogprobs
from gearshift.worker.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
WITH_PROMPT = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)


def _run(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]]):
    for rid, ids, params in requests:
        engine.add_request(rid, ids, params)
    tokens: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    prompt: dict[str, list[TokenLogprobs] | None] = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.prompt_logprobs is not None:
                assert out.request_id not in prompt, "prompt logprobs come once"
                prompt[out.request_id] = out.prompt_logprobs
    return tokens, prompt


def _reference(folder, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return logits.log_softmax(dim=-1)


def test_prompt_logprobs_equal_a_plain_forward_across_chunks_and_cache_hits(
    tiny_checkpoint, engine_factory
):
    folder = tiny_checkpoint("llama3-scaled")
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 128, (21,), generator=g).tolist()
    other = torch.randint(0, 128, (9,), generator=g).tolist()
    engine = engine_factory(
        folder, skip_tokenizer_init=True, max_num_batched_tokens=7, block_size=4, record=False
    )
    # "warm" fills the prefix cache; "again" would hit it, yet must score its whole prompt.
    plain, _ = _run(engine, [("warm", shared, GREEDY), ("side", other, GREEDY)])
    tokens, prompt = _run(engine, [("again", shared, WITH_PROMPT), ("side2", other, GREEDY)])
    assert tokens["again"] == plain["warm"] and tokens["side2"] == plain["side"]
    assert set(prompt) == {"again"} or prompt.get("side2") is None
    scored = prompt["again"]
    assert scored is not None and len(scored) == len(shared) - 1
    ref = _reference(folder, shared)
    for q, lp in enumerate(scored):
        assert lp.token_id == shared[q + 1]
        assert abs(lp.logprob - float(ref[q, shared[q + 1]])) < 1e-4
        assert len(lp.top) == 2
        best = ref[q].topk(2)
        assert [t for t, _ in lp.top] == best.indices.tolist()
        assert lp.rank == int((ref[q] > ref[q, shared[q + 1]]).sum()) + 1
