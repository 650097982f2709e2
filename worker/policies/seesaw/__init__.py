"""The ``seesaw`` policy: Seesaw's PP prefill ↔ TP decode re-sharding over a host KV tier."""

from gearshift.worker.policies.seesaw.policy import SeesawPolicy

__all__ = ["SeesawPolicy"]
