"""Ranks sharing a host's cores (``operator/sim/shared_cores.py``) and the Tetris group run on
them (``tetris_sim.TetrisGroupSim.host_cores``)."""

from __future__ import annotations

import dataclasses

import pytest

from gearshift.operator.planner.cdsp import PlannerRules, plan_request
from gearshift.operator.planner.instance_pool import Pool
from gearshift.operator.planner.latency_model import LatencyModel
from gearshift.operator.sim.events import EventLoop
from gearshift.operator.sim.replica import ReplicaConfig
from gearshift.operator.sim.shared_cores import SharedCores
from gearshift.operator.sim.tetris_sim import RECEIVE_STEP_S, TetrisGroupSim, simulate_tetris
from gearshift.operator.sim.trace import TraceRequest


def _ends(cores: int, tasks: list[tuple[float, float, int]]) -> dict[int, float]:
    """Run (start, seconds, ranks) tasks on ``cores``; when each ended, by index."""
    loop = EventLoop()
    host = SharedCores(loop, cores)
    ends: dict[int, float] = {}
    for i, (start, seconds, ranks) in enumerate(tasks):
        done = lambda i=i: ends.__setitem__(i, loop.now)
        loop.at(start, lambda s=seconds, r=ranks, d=done: host.run(s, r, d))
    loop.run()
    return ends


def test_tasks_within_the_cores_run_at_full_speed() -> None:
    assert _ends(2, [(0.0, 3.0, 1), (1.0, 1.0, 1)]) == {0: 3.0, 1: 2.0}


def test_more_busy_ranks_than_cores_share_them_and_speed_up_when_one_ends() -> None:
    # A 2-rank ring chunk of 3 s beside a 1-rank step of 1 s on 2 cores: both at 2/3 speed, so
    # the step ends at 1.5 s; the chunk has 2 s left then and runs alone at full speed.
    ends = _ends(2, [(0.0, 3.0, 2), (0.0, 1.0, 1)])
    assert ends[1] == pytest.approx(1.5, abs=1e-12)
    assert ends[0] == pytest.approx(3.5, abs=1e-12)
    # One core, a task joining later: 1 s alone, then 2 tasks at half speed.
    ends = _ends(1, [(0.0, 2.0, 1), (1.0, 0.5, 1)])
    assert ends[1] == pytest.approx(2.0, abs=1e-12)
    assert ends[0] == pytest.approx(2.5, abs=1e-12)


def test_a_lock_step_gang_advances_only_while_all_its_ranks_hold_a_core() -> None:
    loop = EventLoop()
    host = SharedCores(loop, 2, gangs=True)
    ends: dict[str, float] = {}

    def done(name: str) -> None:
        ends[name] = loop.now

    # A 2-rank ring of 2 s beside a 1-rank step of 1 s on 2 cores: each rank's share is 2/3,
    # so the step runs at 2/3 (ends at 1.5 s) and the ring at (2/3)² = 4/9: 2/3 s of its work
    # done by then, 4/3 s left alone at full speed.
    host.run(2.0, 2, lambda: done("ring"))
    host.run(1.0, 1, lambda: done("step"))
    loop.run()
    assert ends["step"] == pytest.approx(1.5, abs=1e-12)
    assert ends["ring"] == pytest.approx(1.5 + 2.0 - 1.5 * 4 / 9, abs=1e-12)
    # Within the cores a gang runs at full speed.
    assert _ends(3, [(0.0, 2.0, 2), (0.0, 1.0, 1)]) == {1: 1.0, 0: 2.0}


def test_a_slowed_task_runs_slower_only_in_company() -> None:
    # On 2 cores with beside 2: a slowed 1 s task alone runs at full speed until a plain 0.5 s
    # task joins at 0.5 s (0.5 s of work left); together until 1.0 s (the plain one ends; the
    # slowed one did 0.25 s), then alone again: it ends at 1.25 s.
    loop = EventLoop()
    host = SharedCores(loop, 2, beside=2.0)
    ends: dict[str, float] = {}
    host.run(1.0, 1, lambda: ends.__setitem__("slowed", loop.now), slowed=True)
    loop.at(0.5, lambda: host.run(0.5, 1, lambda: ends.__setitem__("plain", loop.now)))
    loop.run()
    assert ends == pytest.approx({"plain": 1.0, "slowed": 1.25}, abs=1e-12)
    # Something outside the cores computing counts as company too.
    loop = EventLoop()
    host = SharedCores(loop, 2, beside=2.0)
    host.run(1.0, 1, lambda: ends.__setitem__("outside", loop.now), slowed=True)
    loop.at(0.5, lambda: host.set_outside_busy(True))
    loop.at(1.0, lambda: host.set_outside_busy(False))
    loop.run()
    assert ends["outside"] == pytest.approx(1.25, abs=1e-12)
    with pytest.raises(ValueError, match="beside"):
        SharedCores(EventLoop(), 2, beside=0.5)


def test_a_zero_task_ends_at_once_and_bad_tasks_are_refused() -> None:
    assert _ends(1, [(0.0, 1.0, 1), (0.5, 0.0, 1)]) == {1: 0.5, 0: 1.0}
    host = SharedCores(EventLoop(), 2)
    with pytest.raises(ValueError, match="ranks >= 1"):
        host.run(1.0, 0, lambda: None)
    with pytest.raises(ValueError, match="cores must be >= 1"):
        SharedCores(EventLoop(), 0)


@dataclasses.dataclass(frozen=True)
class _FlatDecode:
    """Every decode step costs the same."""

    seconds: float

    def step_time(self, batch: object) -> float:
        del batch
        return self.seconds


def _group(host_cores: int | None) -> TetrisGroupSim:
    # SP 2 halves the per-token time: a long prompt goes to both instances at once.
    rules = PlannerRules(
        {1: LatencyModel(1, 0.01, 1e-3, 0.0, 0.0), 2: LatencyModel(2, 0.02, 5e-4, 0.0, 0.0)},
        chunk_granularity=32,
        max_chunks=1,
    )
    return TetrisGroupSim(
        prefill=2,
        decode=1,
        rules=rules,
        improvement_rate=0.1,
        config=ReplicaConfig(num_blocks=4096, block_size=16, max_model_len=8192),
        decode_cost=_FlatDecode(0.01),
        kv_bytes_per_token=1000.0,
        link_bandwidth=1e9,
        link_latency=1e-3,
        host_cores=host_cores,
    )


def test_an_idle_host_with_enough_cores_lands_each_prefill_at_its_plans_ttft() -> None:
    trace = [TraceRequest(1.0 + 10 * i, 1000 + 500 * i, 4) for i in range(3)]
    plain = simulate_tetris(_group(None), trace)
    roomy = simulate_tetris(_group(3), trace)
    times = [t for r in roomy.requests for t in r.token_times]
    assert times == pytest.approx([t for r in plain.requests for t in r.token_times], abs=1e-9)
    assert len(times) == 12


def test_a_ring_prefill_beside_a_decoding_instance_on_two_cores_runs_at_two_thirds() -> None:
    # r0 decodes for a long time (1000 steps of 10 ms); r1 arrives while it does, and its SP 2
    # chunk shares 2 cores with the decode rank: 3 busy ranks, 2/3 speed.
    group = _group(2)
    trace = [TraceRequest(0.0, 100, 1000), TraceRequest(1.0, 2000, 2)]
    plan = plan_request(2000, Pool.uniform([0.0, 0.0], 8), group.rules, 0.1)
    (chunk,) = plan.chunks
    assert chunk.sp == 2
    slow = simulate_tetris(group, trace).requests[1]
    fast = simulate_tetris(dataclasses.replace(group, host_cores=3), trace).requests[1]
    handoff = group.handoff_s(2000, 2)
    # The first token comes at most three decode steps after the landing (the step under way,
    # the one that admits the landed request, its first decode row); on 2 cores those steps
    # share the cores too (15 ms each).
    fast_prefill = chunk.seconds + handoff
    assert fast_prefill <= fast.ttft <= fast_prefill + 3 * 0.010 + RECEIVE_STEP_S + 1e-9
    slow_prefill = 1.5 * chunk.seconds + handoff
    assert slow_prefill <= slow.ttft <= slow_prefill + 3 * 0.015 + RECEIVE_STEP_S + 1e-9


def test_a_ring_as_a_lock_step_gang_beside_a_decoding_instance_runs_at_four_ninths() -> None:
    group = dataclasses.replace(_group(2), host_gangs=True)
    trace = [TraceRequest(0.0, 100, 1000), TraceRequest(1.0, 2000, 2)]
    (chunk,) = plan_request(2000, Pool.uniform([0.0, 0.0], 8), group.rules, 0.1).chunks
    assert chunk.sp == 2
    got = simulate_tetris(group, trace).requests[1]
    prefill = 2.25 * chunk.seconds + group.handoff_s(2000, 2)
    assert prefill <= got.ttft <= prefill + 3 * 0.015 + RECEIVE_STEP_S + 1e-9
    with pytest.raises(ValueError, match="host_gangs needs host_cores"):
        dataclasses.replace(group, host_cores=None)


def test_an_instance_takes_its_requests_in_arrival_order() -> None:
    # Two long prompts at once on a pool of two: the second waits for the first on both
    # instances (SP 2 each), so its prefill ends one chunk after the first's.
    group = _group(4)
    trace = [TraceRequest(0.0, 3000, 2), TraceRequest(0.0, 3000, 2)]
    a, b = simulate_tetris(group, trace).requests
    seconds = group.rules.models[2].seconds(0, 3000)
    assert b.token_times[0] - a.token_times[0] == pytest.approx(seconds, abs=0.011)
