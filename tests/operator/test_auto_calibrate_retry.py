"""When a failed ``auto.calibrate`` Job is tried again (issue 30, item 4), without a cluster: the
backoff doubles up to its cap, the attempts are bounded, and the settings come from the
environment."""

from __future__ import annotations

import datetime as dt

import pytest

from gearshift.operator.reconcile import calibration_retry as retry
from gearshift.operator.reconcile.settings import OperatorSettings

T0 = dt.datetime(2026, 11, 27, tzinfo=dt.UTC)


def test_the_backoff_doubles_up_to_its_cap() -> None:
    rules = retry.CalibrationRetry(attempts=5, backoff_s=10, max_backoff_s=25)
    assert [rules.backoff(n) for n in (1, 2, 3, 4)] == [10, 20, 25, 25]


def test_a_failed_attempt_waits_then_retries_and_the_last_one_gives_up() -> None:
    rules = retry.CalibrationRetry(attempts=3, backoff_s=60, max_backoff_s=3600)
    soon = retry.decide(rules, 1, T0, T0 + dt.timedelta(seconds=59))
    assert soon == retry.Wait(2, T0 + dt.timedelta(seconds=60))
    assert retry.decide(rules, 1, T0, T0 + dt.timedelta(seconds=60)) == retry.Retry(2)
    # The second failure waits twice as long.
    assert retry.decide(rules, 2, T0, T0 + dt.timedelta(seconds=119)) == retry.Wait(
        3, T0 + dt.timedelta(seconds=120)
    )
    assert retry.decide(rules, 3, T0, T0 + dt.timedelta(days=1)) == retry.GiveUp(3)
    # An unknown failure time counts from now: the whole backoff is waited.
    assert isinstance(retry.decide(rules, 1, None, T0), retry.Wait)


def test_the_retry_settings_come_from_the_environment_and_are_checked() -> None:
    assert OperatorSettings.from_env({}).calibration == retry.CalibrationRetry(3, 300, 3600)
    env = {
        "GEARSHIFT_CALIBRATION_ATTEMPTS": "2",
        "GEARSHIFT_CALIBRATION_BACKOFF_SECONDS": "1",
        "GEARSHIFT_CALIBRATION_BACKOFF_MAX_SECONDS": "4",
    }
    assert OperatorSettings.from_env(env).calibration == retry.CalibrationRetry(2, 1, 4)
    with pytest.raises(ValueError, match="GEARSHIFT_CALIBRATION_ATTEMPTS"):
        OperatorSettings.from_env({"GEARSHIFT_CALIBRATION_ATTEMPTS": "0"})
