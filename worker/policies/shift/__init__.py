"""The ``shift`` policy: Shift Parallelism (SP ↔ TP per step over one KV cache)."""

from gearshift.worker.policies.shift.policy import BASE, DEFAULT_THRESHOLD, SHIFT, ShiftPolicy

__all__ = ["BASE", "DEFAULT_THRESHOLD", "SHIFT", "ShiftPolicy"]
