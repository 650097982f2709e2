"""A policy as users write it, ``{"<kind>": {...}}`` (the CRD's ``spec.policy``, engine.json,
``--policy-config``, router.json), to and from ``gearshift.v1.Policy``, for every kind: built-in
ones sit in the Policy's oneof, a package's travels packed (policy_fields.policy_of)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import yaml
from google.protobuf import json_format
from google.protobuf.message import Message

from gearshift.v1 import policy_fields, policy_pb2
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.policies import kinds


def message_type(kind: str) -> type[Message] | None:
    """The message class of ``kind``, or None for an unknown kind."""
    spec = kinds.spec_of(kind)
    if spec is not None:
        return spec.message
    if kind in policy_fields.POLICY_KINDS:  # auto: in the oneof, without a spec
        return type(getattr(policy_pb2.Policy(), kind))
    return None


def from_dict(data: Mapping[str, Any]) -> policy_pb2.Policy:
    """``{"<kind>": {...}}`` as a Policy; raises ValueError naming what is wrong."""
    known = kinds.kinds()
    if len(data) != 1:
        raise ValueError("exactly one of " + ", ".join(known) + " must be set")
    ((kind, body),) = data.items()
    cls = message_type(str(kind))
    if cls is None:
        raise ValueError(f"{kind!r} is not a policy kind (known: {', '.join(known)})")
    if not isinstance(body, Mapping):
        raise ValueError(f"{kind} must be an object, got {body!r}")
    try:
        msg = json_format.ParseDict(dict(body), cls())
    except json_format.ParseError as exc:
        raise ValueError(f"{kind}: {exc}") from exc
    return policy_fields.policy_of(str(kind), msg)


def to_dict(policy: policy_pb2.Policy) -> dict[str, Any]:
    """A Policy as ``{"<kind>": {...}}`` in the CRD's (JSON) field names; {} when none is set."""
    kind = policy_fields.kind_of(policy)
    if not kind:
        return {}
    return {kind: json_format.MessageToDict(policy_fields.message_of(policy))}


def parse_policy(raw: str | Mapping[str, Any] | policy_pb2.Policy | None) -> policy_pb2.Policy:
    """The CRD's ``spec.policy`` object (a mapping, or JSON/YAML text) as the proto.

    None means the default, ``{"static": {}}``. Unknown kinds and fields and bad values are
    refused naming the policy.
    """
    if isinstance(raw, policy_pb2.Policy):
        return raw
    if raw is None:
        return from_dict({"static": {}})
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
        return from_dict(data)
    except ValueError as exc:
        raise InvalidRequestError("policy", f"invalid policy: {exc}") from exc
