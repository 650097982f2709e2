"""Seesaw §5.2 (Fig. 8): swap-ins overlap the prefill phase's last steps.

The leader's map of which decode-gear blocks share memory with which prefill-gear blocks
(overlap.py) is checked against the addresses of the real device KV views (rank_hook.DeviceKV).
Under host-store pressure (P2 -> T2), sequences are on-boarded for the decode phase while the
prefill gear still runs: the plans that carry them are prefill-gear plans before the switch,
prefill steps run while their copies are outstanding, no memory those copies write is touched
by the prefill gear up to the switch, and greedy text equals one process.
"""

from __future__ import annotations

import pytest
import torch

from gearshift.worker.engine.plan import StepPlan
from gearshift.worker.policies.seesaw.leader import (
    DECODE_GEAR,
    PREFILL_GEAR,
    SWAP_IN,
    SWAP_IN_GEAR,
    SWAP_OUT,
    Phase,
)
from gearshift.worker.policies.seesaw.overlap import ViewShape, clashes_of
from gearshift.worker.policies.seesaw.policy import PREFETCH_HOLD_ENV
from gearshift.worker.policies.seesaw.rank_hook import DeviceKV, GearKV
from gearshift.worker.sampling.params import SamplingParams
from tests.worker.policies.test_seesaw import (
    _model,
    _seesaw,
    no_leftover_segments,  # noqa: F401 - a fixture
)
from tests.worker.policies.test_seesaw_pressure import (
    BLOCK,
    DEVICE_BLOCKS,
    HOST_PAGES,
    P2,
    PRESSURE,
    T2,
    _trace,
)

# Twice test_seesaw_pressure's device KV (the host store still fills, several times): there each
# prefill block in use rules out the two decode blocks sharing its memory (P2 -> T2, 4 layers,
# 2 KV heads), and the partial prefills' blocks leave too few apart for the oldest host sequence.
EARLY_BLOCKS = 2 * DEVICE_BLOCKS


def _spans(kv: DeviceKV, gear: int, block: int) -> list[tuple[int, int]]:
    """Byte ranges [start, end) of ``block`` in ``gear``'s view, every layer, keys and values."""
    out = []
    for k, v in kv.views[gear]:
        for t in (k, v):
            b = t[block]
            out.append((b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()))
    return out


def _share(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> bool:
    return any(s < f and t < e for s, e in a for t, f in b)


@pytest.mark.parametrize(
    "prefill,decode,blocks",
    [((2, 2), (4, 1), 12), ((2, 2), (4, 1), 7), ((3, 4), (6, 2), 5), ((2, 3), (3, 1), 9),
     ((1, 2), (3, 2), 6), ((4, 1), (2, 2), 8)],
)  # fmt: skip
def test_clash_map_equals_the_device_kv_addresses(prefill, decode, blocks):
    shapes = [ViewShape(*prefill), ViewShape(*decode)]
    gears = [GearKV(range(s.layers), range(s.heads), True) for s in shapes]
    kv = DeviceKV(gears, blocks, 2, 3, torch.float32, torch.device("cpu"))
    for d in range(blocks):
        want = {p for p in range(blocks) if _share(_spans(kv, 1, d), _spans(kv, 0, p))}
        assert clashes_of(shapes[1], shapes[0], blocks, d) == want, d


def _swapped_out(plan: StepPlan) -> set[int]:
    out = plan.section(SWAP_OUT)
    return set(out.view(-1, 2)[:, 1].tolist()) if out is not None else set()


def _touched(plan: StepPlan) -> set[int]:
    """Device blocks a plan's forward reads or writes, and those its swap-outs read."""
    touched = {int(s) // BLOCK for s in plan.slot_mapping.tolist() if s >= 0}
    for row, length in zip(plan.block_tables, plan.seq_lens.tolist(), strict=True):
        touched |= set(row[: -(-length // BLOCK)].tolist())
    return touched | _swapped_out(plan)


def test_swap_ins_overlap_the_last_prefill_steps_without_touching_their_memory(
    no_leftover_segments,  # noqa: F811
    monkeypatch,
    tiny_checkpoint,
    group_factory,
    engine_factory,
):
    # Reports wait until each rank has begun 2 more plans: the copies are provably outstanding
    # while the plans after the one that starts them run.
    monkeypatch.setenv(PREFETCH_HOLD_ENV, "2")
    folder = _model(tiny_checkpoint)
    prompts = _trace()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ref = engine_factory(folder, record=False, kv_cache_bytes=64 << 20, **PRESSURE)
    want = [o.token_ids for o in ref.generate(prompts, params)]

    policy = _seesaw(P2, T2, hostKvCapacityBytes=HOST_PAGES * 2048, asyncSwap=True)
    engine = group_factory(folder, policy, kv_cache_bytes=EARLY_BLOCKS * 1024, **PRESSURE)
    got = [o.token_ids for o in engine.generate(prompts, params)]
    stats = engine.stats()
    assert got == want
    assert stats.num_preemptions == 0 and stats.preempted_tokens == 0

    lead = engine.policy.leader
    plans = engine.executor.submitted
    kv = engine.policy.hook.kv  # rank 0's views (rank 1's have the same shapes for P2 -> T2)
    to_decode = [t.plan for t in lead.transitions if t.to is Phase.DECODE]
    sent = {e.ticket: e for e in lead.queue.log if e.what == "sent"}
    ready = {e.ticket: e for e in lead.queue.log if e.what == "ready"}
    early = [e for e in sent.values() if plans[e.plan].gear == PREFILL_GEAR]
    assert early, "no swap-in was issued while the prefill gear ran"
    assert engine.policy.stats()["early_swap_in_sequences"] == sum(
        len(e.request_ids) for e in early
    )
    overlapped = 0
    for s in early:
        plan = plans[s.plan]
        target = plan.section(SWAP_IN_GEAR)
        assert target is not None and int(target[0]) == DECODE_GEAR
        section = plan.section(SWAP_IN)
        assert section is not None and int(section[0]) == s.ticket
        blocks = set(section[1:].view(-1, 2)[:, 1].tolist())
        # Issued before the switch to decode that follows it: the copies start in prefill.
        switch = min(p for p in to_decode if p > s.plan)
        assert all(plans[k].gear == PREFILL_GEAR for k in range(s.plan, switch))
        assert plans[switch].gear == DECODE_GEAR
        # No memory the copies write is touched by the prefill gear from there to the switch
        # (whose swap-outs, made before the re-shard, read the prefill gear's view).
        written = [span for d in blocks for span in _spans(kv, DECODE_GEAR, d)]
        for k in range(s.plan, switch + 1):
            prefill_view = _touched(plans[k]) if k < switch else _swapped_out(plans[k])
            for p in prefill_view:
                assert not _share(written, _spans(kv, PREFILL_GEAR, p)), (s.ticket, k, p)
        # The sequence decodes only after every rank reported it (the board, not the switch).
        r = ready[s.ticket]
        assert r.plan > s.plan and min(r.board[1:]) >= s.ticket
        assert not any(_touched(plans[k]) & blocks for k in range(s.plan + 1, r.plan))
        # Prefill steps ran while these copies were outstanding.
        during = range(s.plan + 1, min(r.plan, switch))
        overlapped += sum(1 for k in during if plans[k].prefill_query_lens)
    assert overlapped, "no prefill step ran while a swap-in was outstanding"
    assert not lead.queue.busy
