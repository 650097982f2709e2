"""The ``tetris`` policy's spec: a prefill pool and decode instances in one group (Tetris §3.2)."""

from __future__ import annotations

from typing import Any

from gearshift.v1 import policy_pb2
from gearshift.worker.policies.rules import Field, G
from gearshift.worker.policies.spec import Check, PolicySpec

_PREFILL = Field("prefill_instances")
_DECODE_GPUS = Field("decode_instances") * Field("decode_tp")


def instance_ranks(msg: Any) -> list[tuple[str, int, range]]:
    """(role, index, global ranks) of every instance: the pool first, then decode (Fig. 4)."""
    pool = msg.prefill_instances * msg.prefill_tp
    out = [
        ("prefill", m, range(m * msg.prefill_tp, (m + 1) * msg.prefill_tp))
        for m in range(msg.prefill_instances)
    ]
    out += [
        ("decode", d, range(pool + d * msg.decode_tp, pool + (d + 1) * msg.decode_tp))
        for d in range(msg.decode_instances)
    ]
    return out


def nodes_error(msg: Any, ranks: int, nodes: int) -> str:
    """Across nodes (§3.2): a ring of instances may cross nodes (point-to-point in the one
    group), but each instance's TP ranks, prefill or decode, share a node."""
    if ranks % nodes:
        return f"{ranks} ranks do not split over {nodes} nodes"
    per = ranks // nodes
    for role, i, members in instance_ranks(msg):
        if members[0] // per != members[-1] // per:
            return (
                f"with {nodes} nodes of {per} ranks, {role} instance {i} (ranks "
                f"{members[0]}-{members[-1]}) would span two nodes; an instance's TP ranks "
                "must share one (change nodes, the instance counts or their TP)"
            )
    return ""


SPEC = PolicySpec(
    kind="tetris",
    message=policy_pb2.TetrisPolicy,
    runtime="gearshift.worker.policies.tetris.policy:TetrisPolicy",
    gpus=_PREFILL * Field("prefill_tp") + _DECODE_GPUS,
    derived={
        # The GPUs left after the decode instances (§3.2).
        "prefill_instances": (G - _DECODE_GPUS) / Field("prefill_tp"),
        "max_sp": _PREFILL,
        # Every prefill instance gets a dedicated backend: the handshake never queues (§4.2).
        "transfer_backends": _PREFILL,
    },
    checks=(
        Check(
            _PREFILL >= 1,
            "no prefill instance fits: the group's GPUs minus decodeInstances × decodeTp "
            "leave none",
        ),
        Check(Field("max_sp") <= _PREFILL, "maxSp must not exceed prefillInstances"),
    ),
    node_check=nodes_error,
    request_planner="gearshift.operator.router.tetris_requests:TetrisRequestPlanner",
)
