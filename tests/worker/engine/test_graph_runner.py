"""The decode-graph runner's bookkeeping on the CPU, capture replaced by direct calls.

A fake forward stands in for the model here: its logits are a function of every input row
(token id, position, slot, length, first block), so a row that was not copied, padded wrongly or
read from anywhere but the static buffers shows in the logits. Engine-level runs with real
models are in test_graphs_engine.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from gearshift.worker.attention.metadata import AttentionMetadata
from gearshift.worker.engine.graph_runner import (
    DecodeGraphs,
    GraphEscape,
    StaticInputs,
    bucket_sizes,
)
from gearshift.worker.engine.host_sync import HostSyncError
from gearshift.worker.engine.plan import StepPlan

VOCAB = 5
WIDTH = 6  # block-table columns the static tables hold
BLOCK = 4


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class FakeForward:
    """Logits row i = (id, position, slot, length, first block, 0) of row i; records its inputs."""

    def __init__(self, read_host: bool = False) -> None:
        self.calls: list[tuple[torch.Tensor, ...]] = []
        self.read_host = read_host

    def __call__(
        self,
        gear: Any,
        ids: torch.Tensor,
        positions: torch.Tensor,
        kv: Any,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        self.calls.append((ids, positions, meta.slot_mapping, meta.seq_lens, meta.block_tables))
        if self.read_host:
            int(meta.seq_lens.max())  # what a capturable step must never do
        cols = (ids, positions, meta.slot_mapping, meta.seq_lens, meta.block_tables[:, 0])
        out = torch.stack([c.float() for c in cols], dim=1)
        return torch.cat((out, torch.zeros(out.shape[0], VOCAB - out.shape[1])), dim=1)


def decode_plan(rows: list[tuple[int, int, int, list[int]]], gear: int = 0) -> StepPlan:
    """A decode-only plan: each row (token, position, slot, block table)."""
    n = len(rows)
    width = max(len(t) for *_, t in rows)
    tables = torch.tensor([t + [0] * (width - len(t)) for *_, t in rows], dtype=torch.int64)
    return StepPlan(
        step=0,
        gear=gear,
        input_ids=torch.tensor([r[0] for r in rows]),
        positions=torch.tensor([r[1] for r in rows]),
        slot_mapping=torch.tensor([r[2] for r in rows]),
        block_tables=tables,
        seq_lens=torch.tensor([r[1] + 1 for r in rows]),
        logits_indices=torch.arange(n),
        num_decodes=n,
        prefill_query_lens=(),
    )


def _graphs(buckets: dict[int, tuple[int, ...]], forward: FakeForward) -> DecodeGraphs:
    top = max(max(b) for b in buckets.values())
    graphs = DecodeGraphs(StaticInputs(top, WIDTH, torch.device("cpu"), (VOCAB, torch.float32)),
                          buckets, BLOCK)  # fmt: skip
    for gear in buckets:
        graphs.capture(gear, SimpleNamespace(name=f"g{gear}"), [], forward, [], cuda=False)
    return graphs


def test_buckets_are_powers_of_two_then_steps_of_16_up_to_the_largest() -> None:
    assert bucket_sizes(1) == (1,)
    assert bucket_sizes(5) == (1, 2, 4, 5)
    assert bucket_sizes(40) == (1, 2, 4, 8, 16, 32, 40)
    assert bucket_sizes(256)[-3:] == (224, 240, 256)


def test_buckets_of_a_gear_that_splits_tokens_are_multiples_of_its_sp_size() -> None:
    assert bucket_sizes(40, 4) == (4, 8, 16, 32, 40)
    assert bucket_sizes(6, 4) == (4, 8)  # the largest bucket is rounded up, never down
    assert all(b % 2 == 0 for b in bucket_sizes(300, 2))


def test_a_replay_reads_only_views_of_the_static_buffers() -> None:
    forward = FakeForward()
    graphs = _graphs({0: (2, 4)}, forward)
    plan = decode_plan([(7, 3, 13, [3]), (9, 5, 21, [5, 2]), (11, 1, 9, [2])])
    graphs.replay(plan, graphs.bucket_for(plan) or 0)
    inputs = graphs.inputs
    for t in forward.calls[-1]:
        assert _same_storage(t, inputs.vectors) or _same_storage(t, inputs.tables)
        assert not _same_storage(t, plan.input_ids) and not _same_storage(t, plan.block_tables)


def test_real_rows_are_the_plans_and_padding_rows_write_no_kv() -> None:
    forward = FakeForward()
    graphs = _graphs({0: (2, 4)}, forward)
    plan = decode_plan([(7, 3, 13, [3]), (9, 5, 21, [5, 2]), (11, 1, 9, [2])])
    bucket = graphs.bucket_for(plan)
    assert bucket == 4
    logits = graphs.replay(plan, bucket)
    assert logits is not None and logits.shape == (3, VOCAB)
    assert logits[:, :5].tolist() == [[7, 3, 13, 4, 3], [9, 5, 21, 6, 5], [11, 1, 9, 2, 2]]
    ids, positions, slots, lens, tables = forward.calls[-1]
    assert ids.shape[0] == 4  # the whole bucket ran
    # The padding row: token 0 at position 0, no KV slot, one position of context.
    assert (ids[3].item(), positions[3].item(), slots[3].item(), lens[3].item()) == (0, 0, -1, 1)
    assert 0 <= tables[3, 0].item() < 6  # a block id the cache has (stale or zero)


def test_the_logits_handed_back_are_a_copy_the_next_replay_cannot_change() -> None:
    graphs = _graphs({0: (2,)}, FakeForward())
    first = graphs.replay(decode_plan([(7, 3, 13, [3])]), 2)
    kept = first.clone() if first is not None else None
    graphs.replay(decode_plan([(8, 4, 14, [4])]), 2)
    assert first is not None and kept is not None and torch.equal(first, kept)


def test_static_buffers_are_reused_by_every_replay_of_every_bucket() -> None:
    forward = FakeForward()
    graphs = _graphs({0: (1, 2, 4)}, forward)
    pointers = {graphs.inputs.vectors.data_ptr(), graphs.inputs.tables.data_ptr()}
    for n in (1, 2, 3, 4, 1):
        plan = decode_plan([(i, i, i, [i]) for i in range(1, n + 1)])
        graphs.replay(plan, graphs.bucket_for(plan) or 0)
    assert {graphs.inputs.vectors.data_ptr(), graphs.inputs.tables.data_ptr()} == pointers
    assert graphs.replays == {(0, 1): 2, (0, 2): 1, (0, 4): 2}


def test_prefill_and_mixed_steps_run_eagerly() -> None:
    graphs = _graphs({0: (1, 2, 4)}, FakeForward())
    decode = decode_plan([(7, 3, 13, [3])])
    prefill = StepPlan(
        step=0,
        gear=0,
        input_ids=torch.tensor([1, 2, 3]),
        positions=torch.tensor([0, 1, 2]),
        slot_mapping=torch.tensor([0, 1, 2]),
        block_tables=torch.tensor([[0]]),
        seq_lens=torch.tensor([3]),
        logits_indices=torch.tensor([2]),
        num_decodes=0,
        prefill_query_lens=(3,),
    )
    mixed = StepPlan(
        step=0,
        gear=0,
        input_ids=torch.tensor([5, 1, 2]),
        positions=torch.tensor([3, 0, 1]),
        slot_mapping=torch.tensor([13, 4, 5]),
        block_tables=torch.tensor([[3], [1]]),
        seq_lens=torch.tensor([4, 2]),
        logits_indices=torch.tensor([0, 2]),
        num_decodes=1,
        prefill_query_lens=(2,),
    )
    assert graphs.bucket_for(decode) == 1
    assert graphs.bucket_for(prefill) is None and graphs.bucket_for(mixed) is None
    assert graphs.eager_decodes == 0  # those are no decode steps that missed their graph


def test_a_batch_larger_than_the_largest_bucket_runs_eagerly() -> None:
    graphs = _graphs({0: (1, 2, 4)}, FakeForward())
    plan = decode_plan([(i, i, i, [i]) for i in range(1, 6)])
    assert graphs.bucket_for(plan) is None
    assert graphs.eager_decodes == 1


def test_more_block_table_columns_than_the_static_tables_run_eagerly() -> None:
    graphs = _graphs({0: (1, 2)}, FakeForward())
    wide = decode_plan([(7, 3, 13, list(range(WIDTH + 1)))])
    assert graphs.bucket_for(wide) is None
    assert graphs.eager_decodes == 1
    # Copied in anyway, the plan would not fit the buffer: it fails, it is never truncated.
    with pytest.raises(RuntimeError):
        graphs.inputs.load(wide, 1)


def test_each_gear_replays_its_own_graphs_and_a_gear_without_graphs_runs_eagerly() -> None:
    forward = FakeForward()
    graphs = _graphs({0: (1, 2), 1: (2, 4)}, forward)
    one = [(7, 3, 13, [3])]
    assert graphs.bucket_for(decode_plan(one, gear=0)) == 1
    assert graphs.bucket_for(decode_plan(one, gear=1)) == 2  # gear 1's smallest bucket
    assert graphs.bucket_for(decode_plan(one, gear=2)) is None  # no graphs: eager
    graphs.replay(decode_plan(one, gear=1), 2)
    assert graphs.replays == {(1, 2): 1}
    assert {key for key in graphs.graphs} == {(0, 1), (0, 2), (1, 2), (1, 4)}


def test_a_step_that_reads_a_device_value_on_the_host_cannot_be_captured() -> None:
    with pytest.raises(HostSyncError):
        _graphs({0: (1,)}, FakeForward(read_host=True))


def test_a_replay_refuses_when_what_its_graph_reads_has_moved() -> None:
    weight = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    graphs = DecodeGraphs(StaticInputs(2, WIDTH, torch.device("cpu"), (VOCAB, torch.float32)),
                          {0: (1,)}, BLOCK)  # fmt: skip
    graphs.capture(0, SimpleNamespace(name="g"), [], FakeForward(), [weight], cuda=False)
    plan = decode_plan([(7, 3, 13, [3])])
    graphs.replay(plan, 1)
    weight.data = torch.zeros(3)  # elsewhere now: a captured graph would read the old address
    with pytest.raises(GraphEscape):
        graphs.replay(plan, 1)


def test_a_replay_refuses_static_inputs_reallocated_after_capture() -> None:
    graphs = _graphs({0: (1,)}, FakeForward())
    graphs.inputs.tables = torch.zeros(2, WIDTH, dtype=torch.int64)
    with pytest.raises(GraphEscape):
        graphs.replay(decode_plan([(7, 3, 13, [3])]), 1)
