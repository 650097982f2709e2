"""The ``static`` policy: one fixed layout (TP × SP × PP) for every step."""

from gearshift.worker.policies.static.policy import StaticPolicy

__all__ = ["StaticPolicy"]
