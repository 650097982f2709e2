"""The policy on the command line: ``--policy-config`` (the CRD's ``spec.policy`` object, as a
file or inline JSON/YAML) or the short flags ``--policy``, ``--tp``, ``--sp``, ``--pp`` and
``--shift-threshold`` for the common cases. `generate`, `serve` and `worker` share them.

The short flags are generic: ``--tp``/``--sp``/``--pp``/``--threshold`` set the field of that
name of any kind that has one, and a bare ``--world-size`` fills the field the kind's spec names
(``world_field``). Torch-free: the router's command line adds these flags too."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from gearshift.v1 import policy_pb2
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.policies import kinds
from gearshift.worker.policies.policy_json import message_type, parse_policy

SHORT_FLAGS = ("policy", "tp", "sp", "pp", "threshold", "world_size")


def add_policy_args(p: argparse.ArgumentParser, world_size: bool = False) -> None:
    p.add_argument(
        "--policy-config",
        default=None,
        help='the CRD\'s spec.policy: a JSON/YAML file or inline, e.g. \'{"static": {"tp": 2}}\'',
    )
    p.add_argument(
        "--policy",
        default=None,
        help="policy kind: static, shift, seesaw, sidp, tetris or a policy package's (default "
        "static); its fields from the flags below or --policy-config",
    )
    p.add_argument("--tp", type=int, default=None, help="tensor parallel (shift: of the base gear)")
    p.add_argument("--sp", type=int, default=None, help="Ulysses sequence parallel")
    p.add_argument("--pp", type=int, default=None, help="pipeline parallel stages (static)")
    p.add_argument(
        "--shift-threshold",
        "--threshold",
        type=int,
        default=None,
        dest="threshold",
        help="shift: scheduled tokens above which the base gear runs (live)",
    )
    if world_size:
        p.add_argument("--world-size", type=int, default=None, help="ranks in the group")


def read_policy_text(text: str) -> str:
    """A policy given as a file's path becomes the file's text; inline text stays."""
    path = Path(text)
    try:
        if len(text) < 4096 and path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidRequestError("policy_config", f"cannot read {text}: {exc}") from exc
    return text


def policy_from_args(args: argparse.Namespace) -> policy_pb2.Policy:
    """The policy the flags describe; refuses --policy-config mixed with short flags."""
    given = [f for f in SHORT_FLAGS if getattr(args, f, None) is not None]
    if args.policy_config is not None:
        if given:
            flags = ", ".join("--" + f.replace("_", "-") for f in given)
            raise InvalidRequestError(
                "policy_config", f"--policy-config already sets the policy; drop {flags}"
            )
        return parse_policy(read_policy_text(args.policy_config))
    kind = args.policy or "static"
    cls = message_type(kind)
    if cls is None:
        known = ", ".join(kinds.kinds())
        raise InvalidRequestError("policy", f"--policy {kind} is not a policy kind ({known})")
    known_fields = cls.DESCRIPTOR.fields_by_name
    fields: dict[str, Any] = {}
    for name in ("tp", "sp", "pp", "threshold"):
        value = getattr(args, name, None)
        if value is None:
            continue
        if name not in known_fields:
            flag = "--shift-threshold" if name == "threshold" else f"--{name}"
            raise InvalidRequestError(name, f"{flag} is not a field of the {kind} policy")
        fields[name] = value
    world = getattr(args, "world_size", None)
    if world is not None:
        _fill_world(kind, fields, world)
    return parse_policy({kind: fields})


def _fill_world(kind: str, fields: dict[str, Any], world: int) -> None:
    """A bare --world-size means all of it: the field the kind's spec names (TP for static, SP
    for shift: the paper's base gear)."""
    if world < 1:
        raise InvalidRequestError("world_size", f"--world-size must be >= 1, got {world}")
    tp, sp, pp = fields.get("tp"), fields.get("sp"), fields.get("pp", 1)
    spec = kinds.spec_of(kind)
    names = spec.message.DESCRIPTOR.fields_by_name if spec is not None else {}
    if tp is None and sp is None:
        fields[spec.world_field if spec is not None else "tp"] = world // pp
    elif tp is None and "tp" in names:
        fields["tp"] = max(1, world // (sp * pp))
    elif sp is None and "sp" in names:
        fields["sp"] = max(1, world // (tp * pp))
    product = fields.get("tp", 1) * fields.get("sp", 1) * pp
    if product != world:
        raise InvalidRequestError(
            "world_size", f"--world-size {world} != the layout's {product} ranks"
        )
