"""Replicas that step together (``operator/sim/lockstep.py``) and SiDP's CaS group step
(``sidp_cost.MeasuredCasCost``)."""

from __future__ import annotations

import dataclasses

import pytest

from gearshift.operator.sim.lockstep import simulate_lockstep
from gearshift.operator.sim.replica import ReplicaConfig
from gearshift.operator.sim.sidp_cost import MeasuredCasCost
from gearshift.operator.sim.simulator import Deployment, simulate
from gearshift.operator.sim.trace import TraceRequest
from gearshift.worker.engine.scheduler import ScheduledBatch
from gearshift.worker.engine.sequence import Sequence


@dataclasses.dataclass(frozen=True)
class _PerToken:
    """A replica's step: a fixed part plus a part per token."""

    fixed: float
    per_token: float

    def step_time(self, batch: ScheduledBatch) -> float:
        return self.fixed + self.per_token * batch.num_tokens


def _batch(decodes: int) -> ScheduledBatch:
    batch = ScheduledBatch()
    for i in range(decodes):
        seq = Sequence(f"s{i}", [0, 0], params=None, max_tokens=4)  # type: ignore[arg-type]
        seq.num_computed_tokens = 1
        batch.decodes.append(seq)
    return batch


def _cas() -> MeasuredCasCost:
    # A replica's step: 10 ms + 5 ms a row. A layer's exchange: 1 ms + 0.1 ms a group row with
    # a busy owner; 2 ms + 0.1 ms a row with an idle one (rows 2 and 12 given, the line goes on).
    return MeasuredCasCost(
        _PerToken(0.010, 0.005),
        layers=4,
        dp=2,
        shared=((2, 0.0012), (12, 0.0022)),
        served=((2, 0.0022), (12, 0.0032)),
    )


def test_a_cas_step_waits_for_the_slowest_replica_and_adds_each_layers_exchange() -> None:
    cost = _cas()
    # Replica 0 with 2 rows (20 ms), replica 1 with 3 (25 ms, the slower): each of the 4 layers
    # has a busy owner and a busy sender, 5 group rows: 1.5 ms each.
    got = cost.group_step_time([_batch(2), _batch(3)])
    assert got == pytest.approx(0.025 + 4 * 0.0015, rel=1e-9)
    # Replica 1 idle (a dummy step): the 2 layers it owns exchange with an idle owner; the 2
    # replica 0 owns have no sender and add nothing.
    alone = cost.group_step_time([_batch(3), None])
    assert alone == pytest.approx(0.025 + 2 * 0.0023, rel=1e-9)
    # Beyond the last point the line goes on.
    assert cost.exchange_seconds(22, owner_busy=True) == pytest.approx(0.0032)


def test_a_cas_step_with_one_busy_replica_is_priced_by_its_step_alone() -> None:
    # Measured alone (its neighbour idle), a replica's step is 8 ms + 4 ms a row.
    cost = dataclasses.replace(_cas(), alone=_PerToken(0.008, 0.004))
    assert cost.group_step_time([_batch(3), None]) == pytest.approx(0.020 + 2 * 0.0023)
    assert cost.group_step_time([None, _batch(3)]) == pytest.approx(0.020 + 2 * 0.0023)
    # Both busy: each beside the other, as before.
    both = cost.group_step_time([_batch(2), _batch(3)])
    assert both == pytest.approx(0.025 + 4 * 0.0015, rel=1e-9)


def test_bad_cas_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="rows increasing"):
        dataclasses.replace(_cas(), shared=((4, 0.1), (2, 0.2)))
    with pytest.raises(ValueError, match="rows increasing"):
        dataclasses.replace(_cas(), served=())
    with pytest.raises(ValueError, match="2 replicas' batches"):
        _cas().group_step_time([_batch(1)])


def _config() -> ReplicaConfig:
    return ReplicaConfig(num_blocks=256, block_size=16, max_model_len=1024)


def test_replicas_in_lock_step_share_every_step_and_the_light_one_waits() -> None:
    # Replica 0 decodes one request; replica 1 a batch of 8. Independently, replica 0 would
    # step faster; in lock step every step ends at the same time on both.
    trace = [TraceRequest(0.0, 8, 20)] + [TraceRequest(0.0, 8, 20) for _ in range(8)]
    picks = [0] + [1] * 8
    result = simulate_lockstep(2, _config(), _cas(), trace, picks)
    by_id = {r.request_id: r for r in result.requests}
    assert len(by_id) == 9 and all(len(r.token_times) == 20 for r in by_id.values())
    assert by_id["r0"].token_times == pytest.approx(by_id["r1"].token_times, rel=1e-12)
    # The same request alone on a replica priced as a CaS step with an idle partner.
    alone = simulate_lockstep(2, _config(), _cas(), trace[:1], [0])
    assert alone.requests[0].e2e < by_id["r0"].e2e
    assert result.rejected == [] and result.preemptions == 0


def test_the_router_places_requests_without_picks_and_an_idle_group_wakes_late() -> None:
    trace = [TraceRequest(0.5 * i, 16, 4) for i in range(6)]
    result = simulate_lockstep(2, _config(), _cas(), trace)
    assert {r.replica for r in result.requests} == {0, 1}
    slept = simulate_lockstep(2, _config(), _cas(), trace, idle_poll_s=0.01)
    # Every request arrives at an idle group here: its first step starts half a poll late.
    for a, b in zip(result.requests, slept.requests, strict=True):
        assert b.ttft == pytest.approx(a.ttft + 0.005, rel=1e-9)


def test_one_replica_in_lock_step_is_the_independent_simulator() -> None:
    @dataclasses.dataclass(frozen=True)
    class _Whole:
        inner: _PerToken

        def group_step_time(self, batches):  # type: ignore[no-untyped-def]
            (batch,) = batches
            return self.inner.step_time(batch)

    trace = [TraceRequest(0.1 * i, 20 + 7 * i, 3 + i) for i in range(8)]
    base = _PerToken(0.010, 0.001)
    one = simulate_lockstep(1, _config(), _Whole(base), trace)
    ref = simulate(Deployment(1, _config(), base), trace)
    got = [t for r in one.requests for t in r.token_times]
    assert got == pytest.approx([t for r in ref.requests for t in r.token_times], rel=1e-12)


def test_bad_lockstep_inputs_are_refused() -> None:
    trace = [TraceRequest(0.0, 8, 2)]
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        simulate_lockstep(0, _config(), _cas(), trace)
    with pytest.raises(ValueError, match="picks must give"):
        simulate_lockstep(2, _config(), _cas(), trace, [2])
    with pytest.raises(ValueError, match="idle_poll_s"):
        simulate_lockstep(2, _config(), _cas(), trace, idle_poll_s=-1)
    too_long = [TraceRequest(0.0, 1000, 100)]
    assert simulate_lockstep(2, _config(), _cas(), too_long).rejected[0][0] == 0
