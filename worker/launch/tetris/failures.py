"""What a Tetris group's controller does when a rank is gone (Tetris §3.2: the pool and the
decode instances fail apart).

A request fails alone when its plan cannot finish. A dead prefill instance is reported with a
queue of ``DEAD_QUEUE_S`` so planners avoid it, its requests fail and plans that name it are
refused; decode instances keep serving. A dead decode rank ends the group. A rank of this host
is seen by its process's exit; one of another node by its control link closing.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from gearshift.worker.errors import GroupFailure
from gearshift.worker.launch.tetris.links import Link
from gearshift.worker.launch.tetris.messages import Complete
from gearshift.worker.launch.tetris.state import GroupState

log = logging.getLogger(__name__)

DEAD_QUEUE_S = 1e9  # a dead prefill instance's reported queue: no planner picks it


def link_lost(
    group: GroupState, role: str, index: int, rank: int, live: list[Link[Any, Any]]
) -> None:
    """An instance's control link closed: a rank of this host is reported by its exit
    (``check_procs``); one of another node by this."""
    if group.closed or rank < len(group.procs):
        return
    role = "prefill" if role == "pool" else "decode"
    rank_down(
        group,
        rank,
        f"{role} instance {index} (rank {rank}, another node) lost its control connection",
        live,
    )


def check_procs(group: GroupState, live: list[Link[Any, Any]]) -> None:
    """Report every rank of this host whose process has exited."""
    if group.closed:
        return
    for rank, proc in enumerate(group.procs):
        if proc.is_alive():
            continue
        role, index, _ = group.policy.role(rank)
        rank_down(
            group,
            rank,
            f"{role} instance {index} (rank {rank}) exited with code {proc.exitcode}",
            live,
        )
        if group.closed:
            return


def rank_down(group: GroupState, rank: int, why: str, live: list[Link[Any, Any]]) -> None:
    """A rank is gone: a decode rank ends the group, a prefill instance fails its requests
    and is reported down (its links leave ``live``, the reader's)."""
    role, index, _ = group.policy.role(rank)
    if role == "decode":
        group.die(f"tetris group: {why}; the group cannot serve without it")
        return
    if index in group.dead_pool:
        return
    log.error("%s", why)
    group.dead_pool[index] = why
    with group.lock:  # its granted pieces will never be sent (their requests fail)
        for key in [k for k in group.granted if k[0] == index]:
            granted = group.granted.pop(key)
            if group.layerwise:  # posted receives from a dead rank fail: drop them
                m, rid, piece = key
                complete = Complete(rid, m, piece, granted.xfer, True)
                group.send(group.decode_conns[granted.decode], complete)
    for link in group.pool_conns[index]:
        with contextlib.suppress(ValueError):
            live.remove(link)
    with group.lock:
        hit = [rid for rid, r in group.requests.items() if index in r.members and not r.done]
    for rid in hit:
        group.fail(rid, GroupFailure(f"{why} during this request's prefill"))
