"""The one place that maps a policy kind to its package.

A process-wide table on purpose: it is written when this module is imported (the built-in
policies) and by ``register`` (a deployment's own or a test's policy), and read by everyone who
turns a ``gearshift.v1.Policy`` into a running policy. Adding a technique is adding its package
and one line here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import yaml
from google.protobuf import json_format

from gearshift.v1 import policy_fields, policy_pb2
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.policies.base import Policy
from gearshift.worker.policies.seesaw import SeesawPolicy
from gearshift.worker.policies.shift import ShiftPolicy
from gearshift.worker.policies.sidp import SidpPolicy
from gearshift.worker.policies.static import StaticPolicy
from gearshift.worker.policies.tetris.policy import TetrisPolicy

_POLICIES: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Make ``cls`` the implementation of ``cls.kind`` (a field of gearshift.v1.Policy)."""
    if cls.kind not in policy_fields.POLICY_KINDS:
        raise ValueError(f"{cls.kind!r} is not a gearshift.v1.Policy kind")
    _POLICIES[cls.kind] = cls
    return cls


def unregister(kind: str) -> None:
    _POLICIES.pop(kind, None)


for _builtin in (StaticPolicy, ShiftPolicy, SeesawPolicy, SidpPolicy, TetrisPolicy):
    register(_builtin)


def implemented() -> tuple[str, ...]:
    return tuple(k for k in policy_fields.POLICY_KINDS if k in _POLICIES)


def parse_policy(raw: str | Mapping[str, Any] | policy_pb2.Policy | None) -> policy_pb2.Policy:
    """The CRD's ``spec.policy`` object (a mapping, or JSON/YAML text) as the proto.

    None means the default, ``{"static": {}}``. Unknown fields and bad values are refused naming
    the policy.
    """
    if isinstance(raw, policy_pb2.Policy):
        return raw
    policy = policy_pb2.Policy()
    if raw is None:
        policy.static.SetInParent()
        return policy
    data: Any = raw
    if isinstance(raw, str):
        try:
            data = json.loads(raw)
        except ValueError:
            try:
                data = yaml.safe_load(raw)
            except yaml.YAMLError as exc:
                raise InvalidRequestError(
                    "policy", f"policy is neither JSON nor YAML: {exc}"
                ) from exc
    if not isinstance(data, Mapping):
        raise InvalidRequestError("policy", 'policy must be an object such as {"static": {}}')
    try:
        json_format.ParseDict(dict(data), policy)
    except json_format.ParseError as exc:
        raise InvalidRequestError("policy", f"invalid policy: {exc}") from exc
    if not policy_fields.kind_of(policy):
        raise InvalidRequestError(
            "policy", "exactly one of " + ", ".join(policy_fields.POLICY_KINDS) + " must be set"
        )
    return policy


def make_policy(
    policy: str | Mapping[str, Any] | policy_pb2.Policy | None, world_size: int | None = None
) -> Policy:
    """The running policy for ``policy``; ``world_size`` defaults to what its layout occupies."""
    proto = parse_policy(policy)
    kind = policy_fields.kind_of(proto)
    cls = _POLICIES.get(kind)
    if kind == "auto":
        raise InvalidRequestError(
            "policy.auto",
            "auto is planned by the operator into a concrete policy, which is what workers run; "
            "`gearshift plan` shows the choice for given traffic",
        )
    if cls is None:
        raise InvalidRequestError(
            f"policy.{kind}",
            f"policy {kind!r} is not implemented by this engine yet (implemented: "
            f"{', '.join(implemented())})",
        )
    if world_size is None:
        world_size = max(1, policy_fields.layout_gpus(policy_fields.with_defaults(proto, 1)))
        if kind == "shift" and not getattr(proto, kind).HasField("sp"):
            world_size = getattr(proto, kind).tp or 1
    return cls(proto, world_size)
