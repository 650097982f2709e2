"""Which policies this engine runs: the one rule the operator, `serve` and workers share.

The proto and the CRD describe every policy kind, and each kind's spec (``spec.py`` in its
package) says what the engine refuses although the schema allows it (``static.dp`` > 1, a layout
that does not fit the group, a group spread over nodes it cannot span). Such a spec must be
refused before any process starts (an `InvalidSpec` condition on the resource, exit code 2 from
`gearshift serve` / `gearshift worker`), never by a crash-looping pod. The spec decides
(``checks.refuse``); this module only names the field the way the InferenceDeployment spells it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gearshift.v1 import policy_fields, policy_pb2
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.policies import checks, kinds
from gearshift.worker.policies.registry import make_policy

if TYPE_CHECKING:
    from gearshift.worker.policies.base import Policy


def _spec_field(exc: InvalidRequestError) -> InvalidRequestError:
    field = exc.field if exc.field.startswith("spec.") else f"spec.{exc.field}"
    if not field.startswith("spec.policy"):
        field = f"spec.policy.{exc.field}"
    message = exc.message.removeprefix(f"{exc.field}: ")
    return InvalidRequestError(field, f"{field}: {message}")


def check_supported(
    policy: policy_pb2.Policy, world_size: int | None = None, nodes: int = 1
) -> policy_pb2.Policy:
    """``policy`` with its defaults for the group, or InvalidRequestError(field, message) naming
    the field as in the InferenceDeployment (``spec.policy.static.dp``), which is also what
    engine.json's ``policy`` holds, so one message reads right in both places. Torch-free: the
    operator checks here."""
    kind = policy_fields.kind_of(policy)
    try:
        if kinds.spec_of(kind) is None:
            make_policy(policy, world_size)  # refuses it, saying why
        ranks = checks.default_world(policy) if world_size is None else world_size
        full = checks.refuse(policy, ranks)
        why = checks.nodes_error(full, ranks, nodes)
    except InvalidRequestError as exc:
        raise _spec_field(exc) from exc
    if why:
        raise InvalidRequestError("spec.group.nodes", f"spec.group.nodes: {why}")
    return full


def check_runnable(
    policy: policy_pb2.Policy, world_size: int | None = None, nodes: int = 1
) -> Policy:
    """``check_supported``, then the running policy (its kind's worker-side class, which
    imports torch)."""
    check_supported(policy, world_size, nodes)
    try:
        return make_policy(policy, world_size)
    except InvalidRequestError as exc:
        raise _spec_field(exc) from exc
