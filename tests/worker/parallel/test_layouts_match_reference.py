"""Every parallel layout gives the single-process logits (fp32, gloo, real processes)."""

from __future__ import annotations

import itertools

import pytest
import torch

from gearshift.worker.policies.registry import parse_policy
from gearshift.worker.policies.shift.policy import ShiftPolicy
from gearshift.worker.sampling.params import SamplingParams
from tests.worker.helpers import run_recording

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
ENGINE = {"skip_tokenizer_init": True, "block_size": 4, "max_num_batched_tokens": 16}


def _schedule(vocab: int = 128):
    """Steps of exactly 5, 1, 3 and 5 tokens first (padding paths), then chunked prefills mixed
    with decodes."""
    g = torch.Generator().manual_seed(5)

    def prompt(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    return {
        0: [("a", prompt(5), GREEDY)],
        2: [("b", prompt(2), GREEDY)],
        3: [("c", prompt(3), GREEDY)],
        5: [("d", prompt(41), GREEDY), ("e", prompt(9), GREEDY)],
    }


@pytest.fixture(scope="module", params=[2, 4], ids=["kv2", "kv4"])
def reference(request, tiny_checkpoint):
    """(checkpoint, logits rows per request) from one process: the reference for every layout."""
    from gearshift.worker.config import EngineConfig
    from gearshift.worker.launch import start_engine
    from tests.worker.helpers import RecordingExecutor

    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=request.param)
    engine = start_engine(
        EngineConfig(model=str(folder), dtype="float32", kv_cache_bytes=32 << 20, **ENGINE)
    )
    engine.executor = RecordingExecutor(engine.executor)
    rows = run_recording(engine, _schedule())
    sizes = [plan.num_tokens for plan, _ in engine.executor.records[:4]]
    assert sizes == [5, 1, 3, 5], sizes
    engine.shutdown()
    return folder, rows


def _assert_same(rows, reference_rows):
    assert rows.keys() == reference_rows.keys()
    for rid, entries in rows.items():
        ref = reference_rows[rid]
        assert [c for c, _ in entries] == [c for c, _ in ref], rid
        for (_, got), (_, want) in zip(entries, ref, strict=True):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


LAYOUTS = {
    "tp2": {"static": {"tp": 2}},
    "tp4": {"static": {"tp": 4}},
    "sp2": {"static": {"sp": 2}},
    "sp4": {"static": {"sp": 4}},
    "sp2tp2": {"static": {"sp": 2, "tp": 2}},
    "pp2": {"static": {"pp": 2}},
    "pp2tp2": {"static": {"pp": 2, "tp": 2}},
    "pp2sp2": {"static": {"pp": 2, "sp": 2}},
    "shift-base": {"shift": {"sp": 2, "tp": 2, "threshold": 0}},
    "shift-tp": {"shift": {"sp": 2, "tp": 2, "threshold": 10**6}},
}
QUICK = {"tp2", "sp2", "sp4", "pp2", "shift-base"}


@pytest.mark.parametrize(
    "name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.slow) for n in LAYOUTS]
)
def test_layout_logits_equal_single_process(name, reference, group_factory):
    folder, reference_rows = reference
    engine = group_factory(folder, LAYOUTS[name], **ENGINE)
    rows = run_recording(engine, _schedule())
    _assert_same(rows, reference_rows)
    plans = [plan for plan, _ in engine.executor.records]
    gears = {engine.policy.gear_names[p.gear] for p in plans}
    if name == "shift-base":
        assert gears == {"base"}
    if name == "shift-tp":
        assert gears == {"shift"}
    sp = next(iter(LAYOUTS[name].values())).get("sp", 1)
    if sp > 1 and name != "shift-tp":
        # Ulysses pads every step to a multiple of SP; real tokens are unchanged.
        assert all(p.num_tokens % sp == 0 for p in plans)
        assert any(p.num_tokens > sum(p.prefill_query_lens) + p.num_decodes for p in plans)


class Alternating(ShiftPolicy):
    """Shift policy that changes gear on every step, whatever the batch size."""

    calls = 0

    def choose_gear(self, batch) -> int:
        self.calls += 1
        return self.calls % 2


def test_switching_gear_every_step_reads_the_kv_the_other_gear_wrote(reference, group_factory):
    folder, reference_rows = reference
    shift = {"shift": {"sp": 2, "tp": 2}}
    engine = group_factory(folder, shift, **ENGINE)
    engine.policy = Alternating(parse_policy(shift), 4)
    rows = run_recording(engine, _schedule())
    gears = [p.gear for p, _ in engine.executor.records]
    assert all(a != b for a, b in itertools.pairwise(gears))
    assert engine.gear_switches >= len(gears) - 1
    _assert_same(rows, reference_rows)
