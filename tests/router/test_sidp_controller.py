"""The SiDP mode controller (SiDP §4.3): hysteresis on the mean batch per replica, dwell time,
pins and live parameters."""

from __future__ import annotations

import itertools

import pytest

from gearshift.operator.router.sidp_controller import (
    AUTO,
    CAS,
    WAS,
    ControllerParameters,
    InvalidControllerParameters,
    ModeController,
)
from gearshift.v1 import policy_pb2, worker_pb2


def _controller(**kw: int) -> tuple[ModeController, list[int]]:
    applied: list[int] = []
    params = ControllerParameters(
        **{"cas_enter_batch_size": 8, "was_enter_batch_size": 16, "window_steps": 4, **kw}
    )
    return ModeController(params, applied.append), applied


def test_auto_enters_cas_when_the_mean_batch_per_replica_stays_low_and_leaves_when_high():
    ctl, applied = _controller(min_dwell_steps=0)
    for _ in range(3):
        assert ctl.observe([2, 4]) is None  # the window is not full yet
    assert ctl.observe([2, 4]) == CAS
    assert ctl.observe([30, 30]) is None  # window (3, 3, 3, 30): mean 9.75 < 16
    assert ctl.observe([30, 30]) == WAS  # window (3, 3, 30, 30): mean 16.5 ≥ 16
    assert applied == [CAS, WAS]


def test_between_the_thresholds_nothing_switches():
    ctl, applied = _controller(min_dwell_steps=0)
    for _ in range(50):
        ctl.observe([10, 12])  # mean 11: below WaS entry, above CaS entry
    assert applied == [] and ctl.mode == WAS


@pytest.mark.parametrize("dwell", [0, 5, 20, 64])
def test_an_oscillating_trace_switches_no_more_than_the_dwell_time_allows(dwell: int):
    ctl, applied = _controller(min_dwell_steps=dwell, window_steps=2)
    steps = 400
    for step in range(steps):
        ctl.observe([1, 1] if (step // 3) % 2 == 0 else [100, 100])
    assert len(applied) == ctl.switches
    assert ctl.switches <= steps // max(1, dwell) + 1
    if dwell >= 5:
        assert ctl.switches >= steps // (dwell + 6) - 1  # it does switch, once per dwell or so
    # Alternating decisions only: the group is never told the mode it is already in.
    assert all(a != b for a, b in itertools.pairwise(applied))


def test_pinned_modes_switch_at_once_and_auto_resumes_live():
    ctl, applied = _controller(min_dwell_steps=1000)
    ctl.update(ControllerParameters(mode=CAS, cas_enter_batch_size=8, was_enter_batch_size=16))
    assert ctl.observe([100]) == CAS
    assert ctl.observe([100]) is None
    ctl.update(
        ControllerParameters(
            mode=AUTO,
            cas_enter_batch_size=8,
            was_enter_batch_size=16,
            window_steps=1,
            min_dwell_steps=0,
        )
    )
    assert ctl.observe([100]) == WAS
    assert applied == [CAS, WAS]


def test_parameters_come_from_the_proto_and_bad_ones_are_refused_naming_the_field():
    msg = policy_pb2.SidpPolicy(
        mode=policy_pb2.SidpPolicy.CAS,
        cas_enter_batch_size=4,
        was_enter_batch_size=12,
        window_steps=3,
        min_dwell_steps=7,
    )
    params = ControllerParameters.from_proto(msg)
    assert (params.mode, params.cas_enter_batch_size, params.min_dwell_steps) == (CAS, 4, 7)
    ctl = ModeController(params, lambda _: None)
    assert ctl.mode == CAS
    with pytest.raises(InvalidControllerParameters) as info:
        ctl.update(ControllerParameters(cas_enter_batch_size=16, was_enter_batch_size=16))
    assert info.value.field == "sidp.was_enter_batch_size"
    assert ctl.params == params  # unchanged


def _stats(mode: int, batches: list[int], group_mode: int = WAS) -> worker_pb2.WorkerStats:
    stats = worker_pb2.WorkerStats(
        policy=policy_pb2.Policy(
            sidp=policy_pb2.SidpPolicy(
                dp=len(batches),
                mode=mode,  # type: ignore[arg-type]
                cas_enter_batch_size=2,
                was_enter_batch_size=4,
                window_steps=2,
                min_dwell_steps=3,
            )
        )
    )
    stats.policy_stats["sidp_mode"] = float(group_mode)
    for r, b in enumerate(batches):
        stats.policy_stats[f"replica{r}_batch"] = float(b)
    return stats


def test_the_served_controller_decides_from_polled_replica_batches_in_auto_only() -> None:
    from gearshift.operator.router.policy_control import PolicyControl

    control = PolicyControl()
    decisions = [control.decide(_stats(AUTO, b)) for b in ([8, 8], [1, 0], [0, 0], [0, 1])]
    # A window of 2 polls: the mean falls below 2 at the third poll; then the group is in CaS.
    assert [d.sidp.mode if d else None for d in decisions] == [None, None, CAS, None]
    # Back to WaS once 3 polls have passed since the switch (one was above) and the window's
    # mean reaches 4: [0.5, 6] is 3.25, [6, 6] is 6.
    later = [control.decide(_stats(AUTO, [6, 6])) for _ in range(4)]
    assert [d.sidp.mode if d else None for d in later] == [None, WAS, None, None]
    # A pinned group is the worker's: nothing to decide.
    assert control.decide(_stats(CAS, [0, 0])) is None
    # Not a sidp group (or no replica figures): no controller.
    assert control.decide(worker_pb2.WorkerStats(policy=policy_pb2.Policy())) is None
    assert control.decide(_stats(AUTO, [])) is None
