"""When a failed ``auto.calibrate`` profiling Job is tried again (issue 30, item 4). Pure: the
Job's attempt number, when it failed, the settings and the time in; a decision out.

Attempt ``n`` (1 is the first Job) that failed at ``t`` is followed by attempt ``n + 1`` at
``t + min(backoff_s * 2**(n - 1), max_backoff_s)``: 5, 10, 20 ... minutes by default, capped at an
hour, as Kubernetes backs off a crash-looping container. After ``attempts`` failed attempts (3 by
default) the operator gives up and reports the field; deleting the Job starts over, and so does a
change of the calibration's key (its model shape, GPU type, image or group size name another
Job). The count lives in an annotation of the calibration's ConfigMap, which outlives each Job.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

# On the calibration's ConfigMap: the current Job's attempt number, and the uid of the failed
# Job already deleted (a pass that sees it again sees a deletion still in flight, not a new
# failure).
ATTEMPT_ANNOTATION = "gearshift.dev/calibration-attempt"
RETIRED_ANNOTATION = "gearshift.dev/calibration-retired-job"


@dataclass(frozen=True)
class CalibrationRetry:
    """``GEARSHIFT_CALIBRATION_ATTEMPTS``, ``..._BACKOFF_SECONDS``, ``..._BACKOFF_MAX_SECONDS``."""

    attempts: int = 3
    backoff_s: float = 300.0
    max_backoff_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError(
                "GEARSHIFT_CALIBRATION_ATTEMPTS >= 1 and 0 <= GEARSHIFT_CALIBRATION_BACKOFF_SECONDS"
                f" <= GEARSHIFT_CALIBRATION_BACKOFF_MAX_SECONDS, got {self}"
            )

    def backoff(self, attempt: int) -> float:
        """Seconds between attempt ``attempt``'s failure and the next attempt."""
        return min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s)


@dataclass(frozen=True)
class Retry:
    """Delete the failed Job and create attempt ``attempt`` now."""

    attempt: int


@dataclass(frozen=True)
class Wait:
    """Attempt ``attempt`` comes at ``at``."""

    attempt: int
    at: dt.datetime


@dataclass(frozen=True)
class GiveUp:
    attempts: int


def decide(
    rules: CalibrationRetry, attempt: int, failed_at: dt.datetime | None, now: dt.datetime
) -> Retry | Wait | GiveUp:
    """What follows attempt ``attempt``'s failure at ``failed_at`` (None: unknown, taken as now)."""
    if attempt >= rules.attempts:
        return GiveUp(attempt)
    at = (failed_at or now) + dt.timedelta(seconds=rules.backoff(attempt))
    return Retry(attempt + 1) if now >= at else Wait(attempt + 1, at)
