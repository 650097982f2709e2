"""Point-to-point traffic between ranks, under NCCL's contract (``channel.py``), and the rules
that check it on gloo (``rules.py``, ``header.py``, ``checked.py``)."""

from gearshift.worker.p2p.channel import P2P, Pending, Recv, Send
from gearshift.worker.p2p.rules import (
    COMM_RULES_ENV,
    CommRules,
    RuleViolation,
    comm_rules,
    start_rules,
)

__all__ = [
    "COMM_RULES_ENV",
    "P2P",
    "CommRules",
    "Pending",
    "Recv",
    "RuleViolation",
    "Send",
    "comm_rules",
    "start_rules",
]
