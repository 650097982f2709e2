"""The ``static`` policy's spec: one layout, tp × pp × sp × dp = G."""

from __future__ import annotations

from gearshift.v1 import policy_pb2
from gearshift.worker.policies.rules import Field, same
from gearshift.worker.policies.spec import Check, PolicySpec

SPEC = PolicySpec(
    kind="static",
    message=policy_pb2.StaticPolicy,
    runtime="gearshift.worker.policies.static.policy:StaticPolicy",
    gpus=Field("tp") * Field("pp") * Field("sp") * Field("dp"),
    # dp is `vllm serve --data-parallel-size` under engine: vllm; the gearshift engine scales
    # out with `replicas` instead.
    refusals=(
        Check(same(Field("dp"), 1), "the gearshift engine needs 1; scale out with replicas", "dp"),
    ),
)
