"""Which policies this engine runs: the one rule the operator, `serve` and workers share.

The proto and the CRD describe every policy of DESIGN.md, but the engine implements only the
policies in the registry (``registry.py``). A spec asking for anything else, or for a layout a
policy refuses (``static.dp`` > 1), must be refused before any process starts (an `InvalidSpec`
condition on the resource, exit code 2 from `gearshift serve` / `gearshift worker`), never by a
crash-looping pod. The registry decides; this module only names the field the way the
InferenceDeployment spells it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gearshift.v1 import policy_pb2
from gearshift.worker.errors import InvalidRequestError

if TYPE_CHECKING:
    from gearshift.worker.policies.base import Policy


def check_runnable(
    policy: policy_pb2.Policy, world_size: int | None = None, nodes: int = 1
) -> Policy:
    """The running policy for ``policy``, or InvalidRequestError(field, message) naming the
    field as in the InferenceDeployment (``spec.policy.static.dp``), which is also what
    engine.json's ``policy`` holds, so one message reads right in both places."""
    # Imported here: the policies import torch, and the router's command line (which never
    # does) imports this module.
    from gearshift.worker.policies.registry import make_policy

    try:
        # A policy of several engine replicas is served by one worker endpoint that hosts its
        # replica group (worker/server/replica_engine.py).
        running = make_policy(policy, world_size)
    except InvalidRequestError as exc:
        field = exc.field if exc.field.startswith("spec.") else f"spec.{exc.field}"
        if not field.startswith("spec.policy"):
            field = f"spec.policy.{exc.field}"
        raise InvalidRequestError(field, f"{field}: {exc.message}") from exc
    running.check_nodes(nodes)
    return running
