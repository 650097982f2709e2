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


def _stats(
    mode: int, counters: list[tuple[int, int]], group_mode: int = WAS
) -> worker_pb2.WorkerStats:
    """A served group's stats: each replica's cumulative (steps, generated tokens)."""
    stats = worker_pb2.WorkerStats(
        policy=policy_pb2.Policy(
            sidp=policy_pb2.SidpPolicy(
                dp=len(counters),
                mode=mode,  # type: ignore[arg-type]
                cas_enter_batch_size=2,
                was_enter_batch_size=4,
                window_steps=20,
                min_dwell_steps=30,
            )
        )
    )
    stats.policy_stats["sidp_mode"] = float(group_mode)
    for r, (steps, tokens) in enumerate(counters):
        stats.policy_stats[f"replica{r}_steps"] = float(steps)
        stats.policy_stats[f"replica{r}_generation_tokens"] = float(tokens)
    return stats


def test_windows_and_dwell_count_steps_however_many_one_observation_covers():
    ctl, applied = _controller(window_steps=10, min_dwell_steps=50)
    assert ctl.observe_steps(9, 1.0) is None  # 9 steps: the window (10 steps) is not full
    assert ctl.observe_steps(1, 1.0) == CAS
    # 40 steps at batch 100: the window is full of them, but 40 < 50 steps since the switch.
    assert ctl.observe_steps(40, 100.0) is None
    assert ctl.observe_steps(9, 100.0) is None  # 49
    assert ctl.observe_steps(1, 100.0) == WAS  # 50
    # The window is the last 10 steps: the newest 4 of a run at batch 20 and 6 at batch 2
    # average 9.2, not below the CaS entry (8); 4 more at batch 2 push the run out: mean 2.
    assert ctl.observe_steps(60, 20.0) is None
    assert ctl.observe_steps(6, 2.0) is None
    assert ctl.mean_batch() == pytest.approx((4 * 20 + 6 * 2) / 10)
    assert ctl.observe_steps(4, 2.0) == CAS
    assert applied == [CAS, WAS, CAS] and ctl.steps == 130


def test_steps_between_polls_give_group_steps_and_the_mean_batch_per_replica():
    from gearshift.operator.router.sidp_controller import steps_between

    # WaS: replica 0 ran 10 steps at batch 4, replica 1 was idle (batch 0): 10 group steps,
    # mean batch per replica 2.
    assert steps_between({0: (5, 50), 1: (7, 7)}, {0: (15, 90), 1: (7, 7)}) == (10, 2.0)
    # CaS: both stepped 8 times, 3 and 1 sequences.
    assert steps_between({0: (0, 0), 1: (0, 0)}, {0: (8, 24), 1: (8, 8)}) == (8, 2.0)
    assert steps_between({0: (3, 3)}, {0: (3, 3)}) == (0, 0.0)
    assert steps_between({0: (9, 9)}, {0: (2, 2)}) is None  # the group restarted
    assert steps_between({0: (1, 1)}, {0: (1, 1), 1: (0, 0)}) is None  # other replicas
    assert steps_between({}, {0: (1, 1)}) is None  # the first poll


def test_the_served_controller_decides_from_polled_step_counters_in_auto_only() -> None:
    from gearshift.operator.router.policy_control import PolicyControl

    control = PolicyControl()

    def decide(c0: tuple[int, int], c1: tuple[int, int], mode: int = AUTO) -> int | None:
        d = control.decide(_stats(mode, [c0, c1]))
        return d.sidp.mode if d else None

    assert decide((0, 0), (0, 0)) is None  # the first poll: nothing to compare with
    assert decide((15, 120), (15, 120)) is None  # 15 steps at batch 8: window (20) not full
    # 10 steps at 0.75 per replica: the last 20 steps are 10 at 8 and these 10, mean 4.375.
    assert decide((25, 130), (25, 125)) is None
    assert decide((45, 140), (45, 130)) == CAS  # 20 steps at 0.375 per replica
    # Dwell is 30 steps: 20 busy steps (batch 6) later the window says WaS, the dwell does not.
    assert decide((65, 260), (65, 250)) is None
    assert decide((75, 320), (75, 310)) == WAS  # 30 steps since the switch, mean 6
    # A pinned group is the worker's: nothing to decide.
    assert decide((80, 320), (80, 310), mode=CAS) is None
    # Not a sidp group (or no replica figures): no controller.
    assert control.decide(worker_pb2.WorkerStats(policy=policy_pb2.Policy())) is None
    assert control.decide(_stats(AUTO, [])) is None


def test_thresholds_from_a_profile_put_b_th_where_was_starts_winning_for_good():
    from gearshift.operator.router.sidp_controller import thresholds_from_profile

    was = {1: 10.0, 8: 11.0, 32: 12.0, 64: 14.0}
    # CaS wins up to batch 8, WaS from 32 on: B_th is 32.
    assert thresholds_from_profile(was, {1: 5.0, 8: 9.0, 32: 13.0, 64: 20.0}) == (32, 64)
    # A dip of CaS below WaS at a large batch moves B_th above it.
    assert thresholds_from_profile(was, {1: 5.0, 8: 12.0, 32: 11.0, 64: 20.0}) == (64, 128)
    # CaS wins everywhere measured: B_th is beyond the largest batch.
    assert thresholds_from_profile(was, {b: 1.0 for b in was}) == (128, 256)
    # CaS never wins: pin WaS.
    assert thresholds_from_profile(was, {b: 99.0 for b in was}) is None


def test_thresholds_the_group_measured_replace_the_policys_defaults() -> None:
    from gearshift.operator.router.policy_control import PolicyControl
    from gearshift.worker.policies.sidp.thresholds import SOURCE_EXPLICIT, SOURCE_MEASURED

    def decide(control: PolicyControl, c: tuple[int, int], source: int) -> int | None:
        stats = _stats(AUTO, [c, c])
        # The group timed CaS ahead up to batch 8 at start-up: B_th 16 (the policy says 2).
        stats.policy_stats.update(
            {
                "sidp_thresholds_source": float(source),
                "sidp_cas_enter_batch_size": 16.0,
                "sidp_was_enter_batch_size": 32.0,
                "sidp_auto_pins_was": 0.0,
            }
        )
        d = control.decide(stats)
        return d.sidp.mode if d else None

    measured, explicit = PolicyControl(), PolicyControl()
    for control, source in ((measured, SOURCE_MEASURED), (explicit, SOURCE_EXPLICIT)):
        assert decide(control, (0, 0), source) is None
    # 20 steps at batch 5 per replica: below the measured 16, above the policy's 2.
    assert decide(measured, (20, 100), SOURCE_MEASURED) == CAS
    # Thresholds the policy set (live) are reported as explicit: the policy's own apply.
    assert decide(explicit, (20, 100), SOURCE_EXPLICIT) is None


def test_auto_pins_was_when_cas_never_won_and_switches_a_cas_group_back() -> None:
    from gearshift.operator.router.policy_control import PolicyControl
    from gearshift.operator.router.sidp_controller import ServedGroupControl
    from gearshift.worker.policies.sidp.thresholds import SOURCE_MEASURED

    def stats(c: tuple[int, int], group_mode: int = WAS) -> worker_pb2.WorkerStats:
        out = _stats(AUTO, [c, c], group_mode)
        out.policy_stats.update(
            {"sidp_thresholds_source": float(SOURCE_MEASURED), "sidp_auto_pins_was": 1.0}
        )
        return out

    control = PolicyControl()
    assert control.decide(stats((0, 0))) is None
    # 40 steps at batch 0.25 per replica, far below the policy's 2: still WaS.
    assert control.decide(stats((40, 10))) is None
    assert control.decide(stats((80, 20))) is None
    served = control.controller
    assert isinstance(served, ServedGroupControl)
    assert "AUTO pins WaS" in served.pinned_why and "measured at start-up" in served.pinned_why
    # A group left in CaS (a pin before AUTO) is handed WaS.
    d = control.decide(stats((90, 30), group_mode=CAS))
    assert d is not None and d.sidp.mode == WAS
