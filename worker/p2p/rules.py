"""Which rules point-to-point traffic is held to: ``GEARSHIFT_COMM_RULES``, and the tag guard.

``gloo`` (or unset) runs traffic as it is. ``nccl`` holds gloo runs to NCCL's rules, so a CPU
test proves what a GPU cluster needs (DESIGN.md, GPU path): every message carries a header that
its receive checks (``header.py``), opposite-direction traffic between two peers must be one
batched exchange, and no message may carry a tag (NCCL has none: it matches each pair's messages
in the order they were posted).
"""

from __future__ import annotations

import enum
import functools
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

COMM_RULES_ENV = "GEARSHIFT_COMM_RULES"


class CommRules(enum.Enum):
    """``PLAIN``: traffic as it is; ``NCCL``: gloo traffic checked against NCCL's rules."""

    PLAIN = "gloo"
    NCCL = "nccl"


def comm_rules(environ: Mapping[str, str] | None = None) -> CommRules:
    """The rules ``GEARSHIFT_COMM_RULES`` asks for; an unknown value raises ValueError naming
    the variable (every rank and launcher calls this at start)."""
    raw = (os.environ if environ is None else environ).get(COMM_RULES_ENV, "").strip().lower()
    if raw in ("", CommRules.PLAIN.value):
        return CommRules.PLAIN
    if raw == CommRules.NCCL.value:
        return CommRules.NCCL
    raise ValueError(
        f"{COMM_RULES_ENV}={raw!r} is not a rule set: use 'gloo' (or leave it unset) for plain "
        "traffic, or 'nccl' to check gloo traffic against NCCL's point-to-point rules"
    )


class RuleViolation(RuntimeError):
    """Traffic that NCCL would mis-deliver or deadlock on (raised only under the NCCL rules)."""


def _refuse_tag(name: str, tag: int, peer: Any) -> None:
    # Read at each call: the guard stays installed in a process whose later groups run plain
    # (a test process hosting rank 0 of several groups).
    if tag and comm_rules() is CommRules.NCCL:
        raise RuleViolation(
            f"{COMM_RULES_ENV}=nccl: {name} with tag {tag} (peer {peer}) refused: NCCL ignores "
            "tags and matches each pair's messages in posting order; send through "
            "gearshift.worker.p2p, which takes no tag"
        )


def _guarded(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        # torch's signature: (tensor, dst|src, group, tag, group_dst|group_src)
        tag = kwargs.get("tag", args[2] if len(args) > 2 else 0)
        _refuse_tag(f"torch.distributed.{name}", int(tag or 0), args[0] if args else kwargs)
        return fn(tensor, *args, **kwargs)

    return call


class _GuardedP2POp(c10d.P2POp):
    """torch's P2POp, refusing a tag and taking the guarded isend/irecv for torch's own."""

    def __new__(cls, op: Callable[..., Any], tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return c10d.P2POp.__new__(cls, getattr(op, "__wrapped__", op), tensor)

    def __init__(self, op: Callable[..., Any], tensor: Any, *args: Any, **kwargs: Any) -> None:
        op = getattr(op, "__wrapped__", op)
        super().__init__(op, tensor, *args, **kwargs)
        _refuse_tag("torch.distributed.P2POp", int(self.tag or 0), self.peer)


_guard_lock = threading.Lock()


def guard_torch_p2p() -> None:
    """Refuse tagged point-to-point calls made straight through ``torch.distributed`` (code that
    bypasses gearshift.worker.p2p) while the NCCL rules are on. Process-wide on purpose: the
    rule is about every message this rank sends, whoever sends it; idempotent. The p2p module
    itself calls torch's unguarded functions (``distributed_c10d``): its hidden tags keep
    headers apart."""
    with _guard_lock:
        if getattr(dist.isend, "__wrapped__", None) is not None:
            return
        for name in ("isend", "irecv", "send", "recv"):
            setattr(dist, name, _guarded(name, getattr(c10d, name)))
        dist.P2POp = _GuardedP2POp  # type: ignore[misc]


def start_rules(environ: Mapping[str, str] | None = None) -> CommRules:
    """A rank's start: read the rules (refusing an unknown value) and, under the NCCL rules,
    install the tag guard."""
    rules = comm_rules(environ)
    if rules is CommRules.NCCL:
        guard_torch_p2p()
    return rules
