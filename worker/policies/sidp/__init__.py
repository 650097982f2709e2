"""SiDP: data-parallel replicas that share FFN weights (WaS, CaS, group-wide mode)."""

from gearshift.worker.policies.sidp.policy import SidpPolicy

__all__ = ["SidpPolicy"]
