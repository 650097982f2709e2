"""Pipeline parallel (static pp > 1): stages, micro-batches in flight, and what one rank does.

Greedy tokens equal one process and transformers; preemption, aborts and prefix-cache hits
behave as on one rank; stages overlap (shown from the ranks' recorded event order); each rank
holds only its stage's layers and their KV.
"""

from __future__ import annotations

import torch

from gearshift.worker.parallel.layout import stage_layers
from gearshift.worker.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ENGINE = {"skip_tokenizer_init": True, "block_size": 4, "max_num_batched_tokens": 32}
PP2 = {"static": {"pp": 2}}


def _prompts(n: int, vocab: int = 128, seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (3 + 5 * i,), generator=g).tolist() for i in range(n)]


def test_stage_layers_are_contiguous_and_cover_the_model():
    assert [stage_layers(30, 3, s) for s in range(3)] == [
        range(0, 10),
        range(10, 20),
        range(20, 30),
    ]
    assert [stage_layers(5, 2, s) for s in range(2)] == [range(0, 3), range(3, 5)]
    assert [len(stage_layers(7, 4, s)) for s in range(4)] == [2, 2, 2, 1]


def test_pipeline_greedy_text_equals_transformers_on_a_gqa_model(tiny_checkpoint, group_factory):
    from transformers import AutoModelForCausalLM

    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=4)
    prompts = _prompts(4)
    engine = group_factory(folder, PP2, record=False, **ENGINE)
    got = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [
            hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]
    assert got == want
    # Each rank holds only its stage: the leader (stage 0) has the embedding and layers 0-1,
    # no final norm, no LM head, and KV for two layers.
    model = engine.executor.runner.gears[0].model
    assert model.model.embed_tokens is not None and model.lm_head is None
    assert model.model.norm is None and len(model.model.layers) == 2
    assert len(engine.executor.runner.kv_caches) == 2


def test_micro_batches_overlap_across_stages(tiny_checkpoint, group_factory, tmp_path, monkeypatch):
    # Every rank logs its step events on the host's monotonic clock ($GEARSHIFT_STEP_TRACE).
    monkeypatch.setenv("GEARSHIFT_STEP_TRACE", str(tmp_path))
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=4)
    engine = group_factory(folder, PP2, record=False, **ENGINE)
    engine.generate(_prompts(8), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    engine.shutdown()
    events = {}
    for rank in (0, 1):
        for line in (tmp_path / f"rank-{rank}.log").read_text().splitlines():
            step, micro, what, ns = line.split()
            events[(rank, int(step), what)] = (int(micro), int(ns))
    steps = sorted({s for (_, s, _) in events})
    assert len({events[(0, s, "start")][0] for s in steps}) == 2, "two micro-batch slots"
    # Stage 0 starts step k+1 before stage 1 has finished step k: the stages overlap.
    overlapped = [
        k
        for k in steps[:-1]
        if events[(0, k + 1, "start")][1] < events[(1, k, "end")][1]
        and events[(0, k + 1, "start")][0] != events[(1, k, "end")][0]
    ]
    assert overlapped, "stage 0 never started a micro-batch while stage 1 ran the previous one"
    # In-flight micro-batches run disjoint sequences, so the engine's steps outnumber what one
    # micro-batch would need.
    assert len(steps) > 12


def test_preemption_aborts_and_prefix_hits_behave_as_on_one_rank(tiny_checkpoint, group_factory):
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=4)
    # 24 blocks of 4 tokens (k and v, 2 KV heads of 8 fp32 values, per layer held): the six
    # requests need 47 blocks, so some are preempted. A stage holds half the layers, so the
    # same number of blocks takes half the bytes there.
    per_layer_block = 2 * 2 * 4 * 8 * 4
    prompts = _prompts(6, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    small = {**ENGINE, "max_model_len": 64}
    single_kv = {**small, "kv_cache_bytes": 24 * 4 * per_layer_block}
    single = group_factory(folder, None, record=False, **single_kv)
    want = [o.token_ids for o in single.generate(prompts, params)]
    assert single.scheduler.num_preemptions > 0
    stage_kv = {**small, "kv_cache_bytes": 24 * 2 * per_layer_block}
    engine = group_factory(folder, PP2, record=False, **stage_kv)
    assert engine.blocks.num_blocks == single.blocks.num_blocks
    got = [o.token_ids for o in engine.generate(prompts, params)]
    assert got == want
    assert engine.scheduler.num_preemptions > 0

    # A repeated prompt hits the prefix cache and gives the same tokens.
    again = engine.generate([prompts[-1]], params)[0]
    assert again.num_cached_tokens > 0 and again.token_ids == want[-1]

    # Aborting a request while its micro-batch is in flight: no more output for it, the
    # others finish, and no block stays allocated (the fixture checks every block is free).
    for i, p in enumerate(prompts[:4]):
        engine.add_request(f"a{i}", p, params)
    engine.step()
    busy = sorted({s.request_id for f in engine.in_flight for s in f.seqs})
    assert busy, "a micro-batch should be in flight"
    assert engine.abort_request(busy[0])
    seen: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id] = seen.get(out.request_id, 0) + 1
    assert busy[0] not in seen
    assert len(seen) == 3
