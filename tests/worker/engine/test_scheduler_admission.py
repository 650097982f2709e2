"""The scheduler's admission limit from a policy (StepRequest.admit_blocks) and its count of
preempted KV tokens (EngineStats.preempted_tokens)."""

from __future__ import annotations

from gearshift.worker.engine.contract import StepKind, StepRequest
from gearshift.worker.engine.scheduler import Scheduler, SchedulerConfig
from gearshift.worker.engine.sequence import Sequence
from gearshift.worker.kv.block_manager import BlockManager
from gearshift.worker.sampling.params import SamplingParams


def _scheduler(blocks: int) -> Scheduler:
    manager = BlockManager(blocks, 4, 8, 32, enable_prefix_caching=False)
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), manager)


def _seq(rid: str, n: int) -> Sequence:
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(max_tokens=4), 4)


def test_admission_stops_at_the_first_prompt_whose_whole_kv_exceeds_admit_blocks():
    s = _scheduler(64)
    for rid, n in (("a", 10), ("b", 8), ("c", 2)):  # 3, 2 and 1 blocks at their whole length
        s.add(_seq(rid, n))
    # 4 blocks: "a" (3) fits, "b" (2) does not; "c" would, but admission keeps arrival order.
    batch = s.schedule(StepRequest(StepKind.PREFILL, admit_blocks=4))
    assert [q.request_id for q, _ in batch.prefills] == ["a"]
    assert [q.request_id for q in s.waiting] == ["b", "c"]
    batch = s.schedule(StepRequest(StepKind.PREFILL, admit_blocks=0))
    assert [q.request_id for q, _ in batch.prefills] == ["a"]  # its next chunk only: none new
    batch = s.schedule(StepRequest(StepKind.PREFILL))
    assert {q.request_id for q, _ in batch.prefills} == {"a", "b", "c"}  # no limit


def test_preempted_tokens_count_the_kv_a_preemption_discards():
    s = _scheduler(3)
    s.add(_seq("a", 8))
    s.add(_seq("b", 4))
    batch = s.schedule()
    assert [q.request_id for q, _ in batch.prefills] == ["a", "b"]
    for seq, n in batch.prefills:
        seq.num_computed_tokens += n
        seq.append_token(7)
    # Both decode: "a" needs a third block, "b" a second; one is free, so "b" is preempted.
    batch = s.schedule()
    assert [q.request_id for q in batch.preempted] == ["b"]
    assert s.num_preemptions == 1 and s.preempted_tokens == 4
