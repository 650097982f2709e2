"""The ``shift`` policy's spec: base gear SP × TP over the whole group (Shift §3.1.2)."""

from __future__ import annotations

from gearshift.v1 import policy_pb2
from gearshift.worker.policies.rules import Field, G, greatest
from gearshift.worker.policies.spec import PolicySpec

SPEC = PolicySpec(
    kind="shift",
    message=policy_pb2.ShiftPolicy,
    runtime="gearshift.worker.policies.shift.policy:ShiftPolicy",
    gpus=Field("sp") * Field("tp"),
    # sp × tp = G (§3.1.2); at least 1, so a group too small for tp reads "uses tp GPUs".
    derived={"sp": greatest(G / Field("tp"), 1)},
    world_field="sp",  # a bare --world-size is the paper's base gear: all of it SP
)
