"""The ``seesaw`` policy's spec: a prefill gear and a decode gear over the same G ranks (§4.1)."""

from __future__ import annotations

from gearshift.v1 import policy_pb2
from gearshift.worker.policies.rules import Const, Field, G, same
from gearshift.worker.policies.spec import Check, PolicySpec

_PRE_TP, _PRE_PP = Field("prefill.tp"), Field("prefill.pp")
_DEC_TP, _DEC_PP = Field("decode.tp"), Field("decode.pp")

SPEC = PolicySpec(
    kind="seesaw",
    message=policy_pb2.SeesawPolicy,
    runtime="gearshift.worker.policies.seesaw.policy:SeesawPolicy",
    gpus=_PRE_TP * _PRE_PP,
    gpus_field="prefill",
    # Pipeline for prefill, tensor parallel for decode (§3.1 observations 1 and 2).
    derived={
        "prefill.tp": Const(1),
        "prefill.pp": G / _PRE_TP,
        "decode.pp": Const(1),
        "decode.tp": G / _DEC_PP,
    },
    checks=(
        Check(
            same(_DEC_TP * _DEC_PP, G),
            "tp × pp must equal the group's GPUs (group.nodes × group.gpusPerNode)",
            "decode",
        ),
        Check(
            Field("switch_to_prefill_at_host_usage") < Field("switch_to_decode_at_host_usage"),
            "switchToPrefillAtHostUsage must be below switchToDecodeAtHostUsage",
        ),
    ),
    refusals=(
        # The leader receives the logits from one rank: both gears' last stages start there.
        Check(
            same(_PRE_PP, 1)
            | same(_DEC_PP, 1)
            | same((_PRE_PP - 1) * _PRE_TP, (_DEC_PP - 1) * _DEC_TP),
            "when both gears are pipelined their last stages must start at the same rank "
            "((pp - 1) × tp equal for prefill and decode)",
            "decode",
        ),
    ),
    single_node="its KV tier is the node's shared memory",  # §4.2
)
