"""The Tetris simulation's hand-off as the engine runs it (Tetris §4.2): transfer slots held
until the decode step that receives a piece has ended, the receive's time inside that step, and
a pool pinned apart from the decode instance (``TetrisGroupSim.pool_cores``), and the pool's
chunks slowed beside other ranks (``pool_beside``)."""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from dataclasses import dataclass

import pytest

from gearshift.operator.planner.cdsp import PlannerRules, plan_request
from gearshift.operator.planner.instance_pool import Pool
from gearshift.operator.planner.latency_model import LatencyModel
from gearshift.operator.sim.replica import ReplicaConfig
from gearshift.operator.sim.tetris_sim import TetrisGroupSim, simulate_tetris
from gearshift.operator.sim.trace import TraceRequest

STEP_S = 0.01  # every decode step, whatever its batch


@dataclass(frozen=True)
class _FlatDecode:
    def step_time(self, batch: object) -> float:
        del batch
        return STEP_S


def _group(**kw: object) -> TetrisGroupSim:
    # Short prompts prefill in about a millisecond on one instance, far faster than a decode
    # step; SP 2 halves the per-token time of long ones.
    rules = PlannerRules(
        {1: LatencyModel(1, 1e-3, 1e-5, 0.0, 0.0), 2: LatencyModel(2, 2e-3, 5e-6, 0.0, 0.0)},
        chunk_granularity=32,
        max_chunks=1,
    )
    group = TetrisGroupSim(
        prefill=2,
        decode=1,
        rules=rules,
        improvement_rate=1.0,  # the smallest SP that fits: one instance per short prompt
        config=ReplicaConfig(num_blocks=4096, block_size=16, max_model_len=8192),
        decode_cost=_FlatDecode(),
        kv_bytes_per_token=1000.0,
        link_bandwidth=1e9,
        link_latency=1e-3,
    )
    return dataclasses.replace(group, **kw)


def _firsts(group: TetrisGroupSim, trace: list[TraceRequest]) -> list[float]:
    return sorted(r.token_times[0] for r in simulate_tetris(group, trace).requests)


BURST = [TraceRequest(0.0, 32, 40) for _ in range(8)]  # eight short prompts at once


def test_a_piece_holds_its_slot_until_the_step_that_receives_it_has_ended() -> None:
    # One slot: a piece lands in one step, and the next piece is granted only once that step
    # has ended, so no two first tokens share a step.
    one = _firsts(_group(transfer_slots=1), BURST)
    gaps = [b - a for a, b in itertools.pairwise(one)]
    assert min(gaps) >= STEP_S - 1e-9, gaps
    # A slot per request: the burst's pieces land together, several first tokens to a step.
    many = _firsts(_group(transfer_slots=8), BURST)
    assert len({round(t, 9) for t in many}) < len(many)
    assert statistics.mean(one) > statistics.mean(many)
    # The default is one slot per prefill instance (the policy's transferBackends default).
    assert _firsts(_group(), BURST) == _firsts(_group(transfer_slots=2), BURST)
    with pytest.raises(ValueError, match="transfer_slots"):
        _group(transfer_slots=0)


def test_a_long_prompt_goes_in_pieces_of_the_transfer_buffer_one_slot_each() -> None:
    from gearshift.worker.launch.tetris.state import pieces_of
    from gearshift.worker.policies.registry import make_policy

    group = _group(transfer_buffer_bytes=100_000)  # 100 rows of 1000 bytes a piece
    # Each member's share cut at the buffer, as the engine's pieces_of cuts it.
    assert group.pieces(250, 1) == [n for _, n in pieces_of({0: 250}, 1000, 100_000)[0]]
    assert group.pieces(250, 2) == [100, 25, 100, 25]
    default = make_policy({"tetris": {"prefill_instances": 2, "decode_instances": 1}})
    assert _group().transfer_buffer_bytes == default.message.transfer_buffer_bytes
    # r0 keeps the decode instance busy; r1's 1000 rows are 10 pieces on 2 slots: 5 rounds,
    # and a freed slot's next piece lands two steps later (its Receive comes after the next
    # step has begun), so the last piece lands about 8 steps after a single piece would.
    trace = [TraceRequest(0.0, 32, 400), TraceRequest(0.5, 1000, 2)]
    one = simulate_tetris(_group(transfer_buffer_bytes=1 << 30), trace).requests[1]
    ten = simulate_tetris(group, trace).requests[1]
    assert 7 * STEP_S - 1e-9 <= ten.ttft - one.ttft <= 9 * STEP_S + 1e-9
    with pytest.raises(ValueError, match="transfer_buffer_bytes"):
        _group(transfer_buffer_bytes=0)


def test_a_receive_lengthens_the_decode_step_that_lands_it() -> None:
    # r0 decodes 200 tokens; r1's 1000-token KV lands in one of r0's steps, which takes the
    # receive's time longer; r1's first token comes one step after it.
    trace = [TraceRequest(0.0, 32, 200), TraceRequest(0.5, 1000, 2)]
    free = simulate_tetris(_group(), trace).requests
    priced = _group(receive_latency=0.004, receive_bandwidth=1e8)
    r0, r1 = simulate_tetris(priced, trace).requests
    receive = priced.receive_s(1000)
    assert receive == pytest.approx(0.004 + 1000 * 1000.0 / 1e8)
    gaps = [b - a for a, b in itertools.pairwise(r0.token_times)]
    long = [i for i, g in enumerate(gaps) if g > STEP_S + 1e-6]
    assert len(long) == 1 and gaps[long[0]] == pytest.approx(STEP_S + receive, abs=1e-9)
    assert r1.token_times[0] == pytest.approx(r0.token_times[long[0] + 1] + STEP_S, abs=1e-9)
    # Unpriced, every step of r0 takes its cost.
    gaps = [b - a for a, b in itertools.pairwise(free[0].token_times)]
    assert max(gaps) == pytest.approx(STEP_S, abs=1e-9)
    with pytest.raises(ValueError, match="a receive needs"):
        _group(receive_bandwidth=0.0)


def test_a_pool_pinned_to_one_core_shares_it_and_leaves_the_decode_steps_alone() -> None:
    # Two 3000-token prompts at once, one per instance: on a pool of one core each prefill
    # takes twice its Eq. (1) time, on two cores its own.
    trace = [TraceRequest(0.0, 3000, 3), TraceRequest(0.0, 3000, 3)]
    (chunk,) = plan_request(3000, Pool.uniform([0.0, 0.0], 8), _group().rules, 1.0).chunks
    assert chunk.sp == 1
    one_core = simulate_tetris(_group(pool_cores=1), trace).requests
    two_cores = simulate_tetris(_group(pool_cores=2), trace).requests
    for slow, fast in zip(one_core, two_cores, strict=True):
        assert slow.ttft - fast.ttft == pytest.approx(chunk.seconds, abs=STEP_S + 1e-9)
        # The decode instance has a core of its own: its steps take their cost.
        assert all(
            b - a == pytest.approx(STEP_S, abs=1e-9)
            for a, b in itertools.pairwise(slow.token_times)
        )
    # A ring over both instances is priced by its Eq. (1) model, measured on those cores:
    # pinned to one core it is not slowed again (its two members' hand-offs, work on that core,
    # are: below).
    ring = [TraceRequest(0.0, 3000, 3)]
    group = _group(improvement_rate=0.1, handoff_is_work=False)
    (chunk,) = plan_request(3000, Pool.uniform([0.0, 0.0], 8), group.rules, 0.1).chunks
    assert chunk.sp == 2
    pinned = simulate_tetris(dataclasses.replace(group, pool_cores=1), ring).requests
    devices = simulate_tetris(group, ring).requests
    assert pinned[0].token_times == pytest.approx(devices[0].token_times, abs=1e-9)
    with pytest.raises(ValueError, match="pool_cores"):
        _group(pool_cores=1, host_cores=2)


def test_the_pool_computes_slower_only_while_another_rank_computes_beside_it() -> None:
    # r1's 3000-token prompt prefills on one instance of a pool pinned to 2 cores. Beside r0's
    # decode steps, which run throughout, it takes the factor times its Eq. (1) time.
    busy = [TraceRequest(0.0, 32, 400), TraceRequest(0.5, 3000, 3)]
    (chunk,) = plan_request(3000, Pool.uniform([0.0, 0.0], 8), _group().rules, 1.0).chunks
    assert chunk.sp == 1
    plain = simulate_tetris(_group(pool_cores=2), busy).requests[1]
    slowed = simulate_tetris(_group(pool_cores=2, pool_beside=1.5), busy).requests[1]
    assert slowed.ttft - plain.ttft == pytest.approx(0.5 * chunk.seconds, abs=STEP_S + 1e-9)
    # The same on cores every rank shares (two busy ranks on two cores: no sharing).
    shared = simulate_tetris(_group(host_cores=2, pool_beside=1.5), busy).requests[1]
    assert shared.ttft == pytest.approx(slowed.ttft, abs=1e-9)
    # Alone on the group the prefill runs at its Eq. (1) time, factor or not.
    alone = [TraceRequest(0.0, 3000, 3)]
    assert (
        simulate_tetris(_group(pool_cores=2, pool_beside=1.5), alone).requests[0].token_times
        == simulate_tetris(_group(pool_cores=2), alone).requests[0].token_times
    )
    # Two prompts at once, one per instance, with the decode instance idle: each chunk is
    # beside the other, so both take the factor times their time.
    pair = [TraceRequest(0.0, 3000, 3), TraceRequest(0.0, 3000, 3)]
    fast = simulate_tetris(_group(pool_cores=2, handoff_is_work=False), pair).requests
    slow = simulate_tetris(
        _group(pool_cores=2, handoff_is_work=False, pool_beside=1.5), pair
    ).requests
    for f, s in zip(fast, slow, strict=True):
        assert s.ttft - f.ttft == pytest.approx(0.5 * chunk.seconds, abs=1e-9)
    with pytest.raises(ValueError, match="pool_beside"):
        _group(pool_beside=1.5)  # a device per rank: nothing to share
    with pytest.raises(ValueError, match="pool_beside"):
        _group(pool_cores=2, pool_beside=0.9)


def test_a_hand_off_is_work_on_the_pools_cores() -> None:
    # The ring above, pinned to one core: its two members' pieces are sent at once, each a
    # rank's work on that core, so they share it and land one hand-off later than as a wait.
    ring = [TraceRequest(0.0, 3000, 3)]
    group = _group(improvement_rate=0.1, pool_cores=1)
    work = simulate_tetris(group, ring).requests[0]
    wait = simulate_tetris(dataclasses.replace(group, handoff_is_work=False), ring).requests[0]
    handoff = group.handoff_s(1500, 1)
    assert work.ttft - wait.ttft == pytest.approx(handoff, abs=1e-9)
    # On cores of their own (two, one a member) each piece's hand-off takes its time.
    two = simulate_tetris(dataclasses.replace(group, pool_cores=2), ring).requests[0]
    two_wait = simulate_tetris(
        dataclasses.replace(group, pool_cores=2, handoff_is_work=False), ring
    ).requests[0]
    assert two.token_times == pytest.approx(two_wait.token_times, abs=1e-9)
    # Two prompts at once on one core: they prefill together, then their hand-offs share the
    # core, so the last first token comes later than with the hand-off as a wait.
    burst = [TraceRequest(0.0, 3000, 3), TraceRequest(0.0, 3000, 3)]
    one = dataclasses.replace(group, improvement_rate=1.0)
    late = simulate_tetris(one, burst).requests
    early = simulate_tetris(dataclasses.replace(one, handoff_is_work=False), burst).requests
    assert max(r.ttft for r in late) > max(r.ttft for r in early) + 1e-6
    # On a device per rank the hand-off is a wait whatever the flag.
    devices = _group(improvement_rate=0.1)
    assert (
        simulate_tetris(devices, ring).requests[0].token_times
        == simulate_tetris(dataclasses.replace(devices, handoff_is_work=False), ring)
        .requests[0]
        .token_times
    )
