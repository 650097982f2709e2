"""A policy against its kind's spec: defaults filled for a group, the GPUs its layout occupies,
and every reason it cannot run there (the CRD's CEL rules say the same: they are rendered from
the same spec, ``operator/reconcile/crd_rules.py``).

Torch-free: the operator, the router, `serve` and the worker all check here, before any rank
starts.
"""

from __future__ import annotations

from gearshift.v1 import policy_fields, policy_pb2
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.policies import kinds
from gearshift.worker.policies.rules import PyEnv, field_path, stored
from gearshift.worker.policies.spec import Check, PolicySpec


def layout_message(spec: PolicySpec) -> str:
    """What the layout rule says (the CRD's message; Python adds the counts)."""
    gpus = spec.gpus.text(spec.gpus_field)
    return f"{gpus} must equal the group's GPUs (group.nodes × group.gpusPerNode)"


def with_defaults(policy: policy_pb2.Policy, group_gpus: int | None = None) -> policy_pb2.Policy:
    """A copy with every unset field given its default.

    Constant defaults come from the ``default_value`` option; derived ones (the spec's, e.g.
    shift.sp = G / tp) need ``group_gpus`` and are left unset without it.
    """
    kind = policy_fields.kind_of(policy)
    if not kind:
        return policy_pb2.Policy()
    msg = policy_fields.copy_of(policy)
    policy_fields.fill_constants(msg)
    spec = kinds.spec_of(kind)
    if spec is not None and group_gpus is not None:
        env = PyEnv(msg, group_gpus)
        for path, expr in spec.derived.items():
            *parents, leaf = path.split(".")
            target = msg
            for name in parents:
                target = getattr(target, name)
            if target.HasField(leaf):
                continue
            value = stored(expr, field_path(msg.DESCRIPTOR, path)[-1], msg.DESCRIPTOR).value(env)
            setattr(target, leaf, value)
    return policy_fields.policy_of(kind, msg)


def _spec(policy: policy_pb2.Policy) -> PolicySpec:
    kind = policy_fields.kind_of(policy)
    spec = kinds.spec_of(kind)
    if spec is None:
        raise InvalidRequestError(f"policy.{kind}", f"policy {kind!r} has no spec")
    return spec


def layout_gpus(policy: policy_pb2.Policy) -> int:
    """GPUs (ranks) the layout of a defaults-filled policy occupies."""
    spec = _spec(policy)
    return int(spec.gpus.value(PyEnv(policy_fields.message_of(policy), 0)))


def _where(spec: PolicySpec, check: Check) -> str:
    return f"policy.{spec.kind}" + (f".{check.field}" if check.field else "")


def layout_errors(policy: policy_pb2.Policy, group_gpus: int) -> list[str]:
    """Why a policy's layout does not fit a group of ``group_gpus`` ranks; empty when it does.

    The CRD's CEL rules say the same, so a policy that reaches a worker by another path (the
    Admin API, `gearshift serve`) is checked the same way.
    """
    kind = policy_fields.kind_of(policy)
    if not kind:
        return ["policy: exactly one of " + ", ".join(kinds.kinds()) + " must be set"]
    spec = kinds.spec_of(kind)
    errors = policy_fields.bound_errors(policy_fields.message_of(policy), f"policy.{kind}")
    if errors or spec is None:
        # auto (no spec) has only its own fields' bounds (margin >= 0) to check here: it is
        # planned into a concrete policy first, which is checked in turn.
        return errors
    full = with_defaults(policy, group_gpus)
    env = PyEnv(policy_fields.message_of(full), group_gpus)
    used = int(spec.gpus.value(env))
    if used != group_gpus:
        where = f"policy.{kind}" + (f".{spec.gpus_field}" if spec.gpus_field else "")
        errors.append(
            f"{where}: {layout_message(spec)}: the layout uses {used} GPUs, the group has "
            f"{group_gpus}"
        )
    errors += [f"{_where(spec, c)}: {c.message}" for c in spec.checks if not c.rule.value(env)]
    return errors


def refuse(policy: policy_pb2.Policy, group_gpus: int) -> policy_pb2.Policy:
    """The policy with its defaults for the group, or InvalidRequestError: the layout errors
    together (naming ``policy.<kind>``), else the first thing the engine cannot run (naming its
    field)."""
    kind = policy_fields.kind_of(policy)
    errors = layout_errors(policy, group_gpus)
    if errors:
        raise InvalidRequestError(f"policy.{kind}" if kind else "policy", "; ".join(errors))
    spec = _spec(policy)
    full = with_defaults(policy, group_gpus)
    env = PyEnv(policy_fields.message_of(full), group_gpus)
    for check in spec.refusals:
        if not check.rule.value(env):
            where = _where(spec, check)
            raise InvalidRequestError(where, f"{where}: {check.message}")
    return full


def nodes_error(policy: policy_pb2.Policy, ranks: int, nodes: int) -> str:
    """Why a defaults-filled policy's group of ``ranks`` cannot spread over ``nodes`` nodes."""
    return _spec(policy).nodes_error(policy_fields.message_of(policy), ranks, nodes)


def default_world(policy: policy_pb2.Policy, rounds: int = 8) -> int:
    """The group size a policy implies when none is given: the G its layout occupies once its
    G-derived defaults are filled for that G (1 when it has none)."""
    g = 1
    for _ in range(rounds):
        used = layout_gpus(with_defaults(policy, g))
        if used < 1 or used == g:
            break
        g = used
    return g
