"""SiDP across GPUs: whether WaS's one-sided reads can reach the owners' GPUs, and what the other
replicas' CUDA contexts cost this GPU (SiDP §4.2 on one GPU per replica).

A WaS read copies an owner's FFN shard from its GPU (mapped over CUDA IPC) into this GPU's slot:
that needs peer access between the two GPUs (NVLink or PCIe P2P). Without it the driver would
stage every copy through host memory, far from the bandwidth WaS is chosen for, so WaS is refused
naming the topology (CaS, which ships activations over NCCL, runs anywhere).

Mapping another process's memory creates a CUDA context of this process on the owner's GPU
(hundreds of MiB there). Every rank maps before any sizes its KV cache, so the KV cache of each
GPU is sized from what the contexts left; the owner measures what they took.
"""

from __future__ import annotations

from collections.abc import Callable

from gearshift.worker.errors import InvalidRequestError


def peer_matrix(devices: list[int], can_access: Callable[[int, int], bool]) -> str:
    """``0->1 yes, 1->0 no, ...`` over every ordered pair of ``devices``."""
    pairs = [(a, b) for a in devices for b in devices if a != b]
    return ", ".join(f"{a}->{b} {'yes' if can_access(a, b) else 'no'}" for a, b in pairs)


def check_peer_access(
    mine: int, owners: set[int], devices: list[int], can_access: Callable[[int, int], bool]
) -> None:
    """Refuse WaS when GPU ``mine`` cannot read every owner GPU in ``owners`` directly;
    ``devices``: the group's GPUs (named in the error), ``can_access``: the driver's answer
    (torch.cuda.can_device_access_peer)."""
    missing = sorted(d for d in owners if d != mine and not can_access(mine, d))
    if missing:
        raise InvalidRequestError(
            "policy.sidp.mode",
            f"policy.sidp.mode: WaS reads FFN weights from the owners' GPUs, but GPU {mine} has "
            f"no peer access to GPU {', '.join(map(str, missing))} (peer access between the "
            f"group's GPUs: {peer_matrix(sorted(set(devices)), can_access)}); use mode CAS, "
            "or GPUs with NVLink or PCIe P2P",
        )
