"""Which policies this engine runs today: the one rule the operator, `serve` and workers share.

The proto and the CRD describe every policy of DESIGN.md, but the engine implements only some of
them. A spec asking for the rest must be refused before any process starts (an `InvalidSpec`
condition on the resource, exit code 2 from `gearshift serve` / `gearshift worker`), never by a
crash-looping pod. Keep the rule here only; everything else calls `check_runnable`.
"""

from __future__ import annotations

from gearshift.v1 import policy_fields, policy_pb2
from gearshift.worker.errors import InvalidRequestError

# Policies whose schema exists but whose engine does not yet (README: "Not done yet").
NOT_IMPLEMENTED = ("seesaw", "sidp", "tetris")


def check_runnable(policy: policy_pb2.Policy) -> None:
    """Raise InvalidRequestError(field, message) when this engine cannot run `policy`.

    Fields are named as in the InferenceDeployment (`spec.policy.static.pp`), which is also what
    engine.json's `policy` holds, so one message reads right in both places.
    """
    kind = policy_fields.kind_of(policy)
    if kind in NOT_IMPLEMENTED:
        field = f"spec.policy.{kind}"
        raise InvalidRequestError(
            field,
            f"{field}: the {kind} policy is not implemented by the gearshift engine yet "
            "(its schema is accepted, no worker can run it); use static or shift",
        )
    if kind == "static":
        static = policy.static
        if static.pp > 1:
            raise InvalidRequestError(
                "spec.policy.static.pp",
                f"spec.policy.static.pp: pipeline parallel is not implemented by the gearshift "
                f"engine yet (pp must be 1, got {static.pp}); use tp or sp",
            )
        if static.dp > 1:
            raise InvalidRequestError(
                "spec.policy.static.dp",
                f"spec.policy.static.dp: the gearshift engine runs one replica per group (dp "
                f"must be 1, got {static.dp}); scale out with spec.replicas",
            )
