"""The running policy of a ``gearshift.v1.Policy``: the kind's worker-side class (``kinds.py``
maps each kind to its package), built for a group.

``register`` puts a test's class in place of a kind's own (restore it with the value it
replaced, which ``_POLICIES`` holds).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gearshift.v1 import policy_fields, policy_pb2
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.policies import checks, kinds
from gearshift.worker.policies.policy_json import parse_policy

if TYPE_CHECKING:
    from gearshift.worker.policies.base import Policy

_POLICIES = kinds.RUNTIMES


def register(cls: type[Policy]) -> type[Policy]:
    """Make ``cls`` the worker-side class of ``cls.kind`` (a kind with a spec)."""
    if kinds.spec_of(cls.kind) is None:
        raise ValueError(f"{cls.kind!r} is not a policy kind with a spec")
    _POLICIES[cls.kind] = cls
    return cls


def unregister(kind: str) -> None:
    _POLICIES.pop(kind, None)


def implemented() -> tuple[str, ...]:
    return tuple(k for k in kinds.kinds() if k in _POLICIES)


def make_policy(
    policy: str | Mapping[str, Any] | policy_pb2.Policy | None, world_size: int | None = None
) -> Policy:
    """The running policy for ``policy``; ``world_size`` defaults to what its layout occupies.

    Imports the kind's worker-side class, and with it torch."""
    proto = parse_policy(policy)
    kind = policy_fields.kind_of(proto)
    kinds.specs()  # the policy packages are known before their classes are looked up
    if kinds.planned(kind):
        raise InvalidRequestError(
            f"policy.{kind}",
            f"{kind} is planned by the operator into a concrete policy, which is what workers "
            "run; `gearshift plan` shows the choice for given traffic",
        )
    entry = _POLICIES.get(kind)
    if entry is None:
        raise InvalidRequestError(
            f"policy.{kind}",
            f"policy {kind!r} is not implemented by this engine yet (implemented: "
            f"{', '.join(implemented())})",
        )
    cls: type[Policy] = kinds.load_ref(entry) if isinstance(entry, str) else entry
    if world_size is None:
        world_size = checks.default_world(proto)
    return cls(proto, world_size)
