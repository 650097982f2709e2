"""Engines with the decode-graph runner on (CPU: capture replaced by direct calls) give the eager
engines' greedy tokens and logits, for static, Shift (both gears) and Seesaw, on one rank and on
several (gloo). Every replay runs under ``NoHostSync`` and checks that nothing it reads moved, so
these runs also prove the captured forward reads no device value and keeps its buffers.
"""

from __future__ import annotations

import pytest
import torch

from gearshift.worker.engine.graph_runner import DecodeGraphs
from gearshift.worker.engine.plan import StepPlan
from gearshift.worker.sampling.params import SamplingParams
from tests.worker.helpers import run_recording

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ENGINE = {"skip_tokenizer_init": True, "block_size": 4, "max_num_batched_tokens": 16}
GRAPHS = {"graphs_on_cpu": True, "max_cudagraph_capture_size": 4}


def _schedule(vocab: int = 128) -> dict[int, list]:
    """Decode steps of 1 to 5 sequences (5: past the largest bucket) and mixed steps."""
    g = torch.Generator().manual_seed(5)

    def prompt(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    return {
        0: [("a", prompt(5), GREEDY)],
        3: [("b", prompt(2), GREEDY)],
        5: [("c", prompt(3), GREEDY), ("d", prompt(7), GREEDY)],
        6: [("e", prompt(9), GREEDY)],
    }


def _graphs_of(engine) -> DecodeGraphs:  # type: ignore[no-untyped-def]
    inner = engine.executor.inner  # RecordingExecutor -> the runner or the group executor
    runner = getattr(inner, "runner", inner)
    assert runner.graphs is not None, "the runner holds no graphs"
    return runner.graphs


def _decode_only(plan: StepPlan) -> bool:
    return not plan.prefill_query_lens and plan.num_decodes > 0


def _assert_same(rows, want) -> None:  # type: ignore[no-untyped-def]
    assert rows.keys() == want.keys()
    for rid, entries in rows.items():
        assert [c for c, _ in entries] == [c for c, _ in want[rid]], rid
        for (_, got), (_, ref) in zip(entries, want[rid], strict=True):
            torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)


def _assert_replayed_exactly_the_decode_steps(engine, largest: int) -> None:  # type: ignore[no-untyped-def]
    graphs = _graphs_of(engine)
    plans = [p for p, _ in engine.executor.records]
    fits = [p for p in plans if _decode_only(p) and p.num_decodes <= largest]
    too_big = [p for p in plans if _decode_only(p) and p.num_decodes > largest]
    assert fits and too_big, "the schedule must hold both kinds of decode steps"
    assert sum(graphs.replays.values()) == len(fits)
    assert graphs.eager_decodes == len(too_big)
    for p in fits:  # each replayed in the smallest bucket that holds it
        assert any(b >= p.num_decodes for g, b in graphs.replays if g == p.gear)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_static_greedy_tokens_and_logits_with_graphs_equal_eager(model, engine_factory, backend):
    eager = run_recording(engine_factory(model, attention_backend=backend, **ENGINE), _schedule())
    engine = engine_factory(model, attention_backend=backend, **ENGINE, **GRAPHS)
    _assert_same(run_recording(engine, _schedule()), eager)
    _assert_replayed_exactly_the_decode_steps(engine, 4)


def test_enforce_eager_turns_the_graphs_off(model, engine_factory):
    engine = engine_factory(model, enforce_eager=True, **ENGINE, **GRAPHS)
    assert engine.executor.inner.graphs is None


def test_shift_replays_the_graphs_of_both_gears_on_one_rank(model, engine_factory):
    from gearshift.worker.config import EngineConfig
    from gearshift.worker.launch import start_engine
    from tests.worker.helpers import RecordingExecutor

    eager = run_recording(engine_factory(model, **ENGINE), _schedule())
    config = EngineConfig(
        model=str(model), dtype="float32", kv_cache_bytes=32 << 20, **ENGINE, **GRAPHS
    )
    # Steps of more than 2 tokens run the base gear, the others the shift gear.
    engine = start_engine(config, {"shift": {"sp": 1, "tp": 1, "threshold": 2}})
    engine.executor = RecordingExecutor(engine.executor)
    try:
        _assert_same(run_recording(engine, _schedule()), eager)
        graphs = _graphs_of(engine)
        assert {gear for gear, _ in graphs.replays} == {0, 1}
        _assert_replayed_exactly_the_decode_steps(engine, 4)
    finally:
        engine.shutdown()


LAYOUTS = {
    "tp2": {"static": {"tp": 2}},
    "sp2": {"static": {"sp": 2}},
    "shift-base": {"shift": {"sp": 2, "tp": 2, "threshold": 0}},
    "shift-tp": {"shift": {"sp": 2, "tp": 2, "threshold": 10**6}},
}


@pytest.mark.parametrize("name", ["tp2", "sp2", "shift-base", "shift-tp"])
def test_multi_rank_graphs_give_the_eager_logits(name, model, engine_factory, group_factory):
    eager = run_recording(engine_factory(model, **ENGINE), _schedule())
    engine = group_factory(model, LAYOUTS[name], **ENGINE, **GRAPHS)
    _assert_same(run_recording(engine, _schedule()), eager)
    graphs = _graphs_of(engine)
    if name.startswith("shift"):
        assert {g for g, _ in graphs.replays} == {0 if name == "shift-base" else 1}
    assert engine.stats().step_phases["broadcast"] > 0.0  # the leader sent every plan
    sp = next(iter(LAYOUTS[name].values())).get("sp", 1)
    if name != "shift-tp":
        # Every bucket of a gear that splits tokens over SP ranks is a multiple of SP.
        assert all(b % sp == 0 for _, b in graphs.replays)
    _assert_replayed_exactly_the_decode_steps(engine, 4)


def test_seesaw_decode_gear_replays_its_graphs_across_reshards(
    tiny_checkpoint, group_factory, engine_factory
):
    from tests.worker.policies.test_seesaw import DEVICE_KV, _model, _prompts, _seesaw
    from tests.worker.policies.test_seesaw import ENGINE as SEESAW

    folder = _model(tiny_checkpoint)
    prompts = _prompts(10)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    ref = engine_factory(folder, record=False, kv_cache_bytes=64 << 20, **SEESAW)
    want = [o.token_ids for o in ref.generate(prompts, params)]
    engine = group_factory(
        folder,
        _seesaw({"tp": 1, "pp": 2}, {"tp": 2, "pp": 1}, pinnedStagingBytes=3072),
        kv_cache_bytes=DEVICE_KV,
        graphs_on_cpu=True,
        max_cudagraph_capture_size=8,
        **SEESAW,
    )
    got = [o.token_ids for o in engine.generate(prompts, params)]
    assert got == want
    graphs = _graphs_of(engine)
    assert set(graphs.buckets) == {1}  # the decode gear only: the prefill gear is pipelined
    assert graphs.replays and {g for g, _ in graphs.replays} == {1}
    stats = engine.policy.stats()
    # The decode gear's weights left the device and came back between replays: every replay
    # checked that they came back to the addresses its graph was captured on.
    assert stats["transitions"] >= 2
