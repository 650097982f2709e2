"""The ``sidp`` policy's spec: dp replicas of tp ranks sharing FFN weights (SiDP §4)."""

from __future__ import annotations

from gearshift.v1 import policy_pb2
from gearshift.worker.policies.rules import Field, G, greatest
from gearshift.worker.policies.spec import Check, PolicySpec

_DP = Field("dp")

SPEC = PolicySpec(
    kind="sidp",
    message=policy_pb2.SidpPolicy,
    runtime="gearshift.worker.policies.sidp.policy:SidpPolicy",
    gpus=_DP * Field("tp"),
    derived={
        "dp": G / Field("tp"),
        # §4.4: dp − 1 slots, which peak shifting needs for a full layer cycle.
        "was_cache_slots": greatest(_DP - 1, 1),
        "prefetch_depth": Field("was_cache_slots"),
    },
    checks=(
        # Hysteresis against flapping (§4.3).
        Check(
            Field("was_enter_batch_size") > Field("cas_enter_batch_size"),
            "wasEnterBatchSize must be above casEnterBatchSize (hysteresis)",
        ),
        Check(
            Field("prefetch_depth") <= Field("was_cache_slots"),
            "prefetchDepth must not exceed wasCacheSlots",
        ),
    ),
    refusals=(
        # A peak-shifted cycle is fetched out of layer order: all dp − 1 remote layers of a
        # cycle must fit, or compute waits for a layer that no free slot can take (§4.4).
        Check(
            ~Field("peak_shifting") | (Field("was_cache_slots") >= _DP - 1),
            "must be at least dp - 1 with peakShifting",
            "was_cache_slots",
        ),
    ),
    single_node="its replicas share FFN weights through the host's shared memory",
    router_controller="gearshift.operator.router.sidp_controller:ServedGroupControl",
)
