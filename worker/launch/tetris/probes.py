"""Worker.ProfileTetris on a running group: CDSP prefill timed on the live pool, between its
requests (Eq. (1)'s samples, Tetris §5.1; ``profile.py`` does the same on a pool of its own).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from gearshift.worker.errors import GroupFailure, InvalidRequestError
from gearshift.worker.launch.tetris.messages import Probe
from gearshift.worker.launch.tetris.state import GroupState
from gearshift.worker.policies.tetris.chunked_prefill import PlannedChunk

MAX_PROFILE_POINTS = 4096  # per ProfileTetris call
WAIT_S = 0.1  # between looks at the replies, the pool's health and the deadline


def profile_running_pool(
    group: GroupState,
    sizes: Sequence[int],
    histories: Sequence[int],
    lengths: Sequence[int],
    repeats: int,
    stop: threading.Event | None = None,
) -> list[tuple[int, int, int, float]]:
    """For every SP size and (history C, length L) point, ``repeats`` runs of a C-token chunk
    then an L-token chunk on the first ``sp`` live instances, in the pool's request order (live
    requests queue with the probes). Returns (sp, C, L, seconds of the L chunk on its slowest
    member). Raises InvalidRequestError naming the field for a grid the pool cannot run,
    GroupFailure when an instance fails meanwhile or ``stop`` is set (the caller went away;
    checked between points)."""
    live = [m for m in range(group.policy.prefill) if m not in group.dead_pool]
    sizes = list(sizes) or list(range(1, len(live) + 1))
    if min(sizes) < 1 or max(sizes) > len(live):
        raise InvalidRequestError(
            "sp_sizes", f"sp_sizes: between 1 and the {len(live)} live prefill instances"
        )
    if not lengths or min(lengths) < 1 or min(histories, default=0) < 0:
        raise InvalidRequestError("lengths", "lengths: at least one, each >= 1")
    if max(histories, default=0) + max(lengths) > group.max_model_len:
        raise InvalidRequestError(
            "lengths",
            f"lengths: history + length up to {max(histories, default=0) + max(lengths)} "
            f"exceeds the model's {group.max_model_len} positions",
        )
    count = len(sizes) * max(1, len(histories)) * len(lengths) * max(1, repeats)
    if count > MAX_PROFILE_POINTS:
        raise InvalidRequestError(
            "repeats",
            f"repeats: the grid has {count} points (sp_sizes x histories x lengths x "
            f"repeats); at most {MAX_PROFILE_POINTS}",
        )
    points = [(0, min(sizes), 0, min(lengths))]  # untimed warm-up
    points += [
        (r + 1, sp, c, n)
        for sp in sizes
        for c in histories
        for n in lengths
        for r in range(max(1, repeats))
    ]
    out = []
    with group.probe_lock:
        for seed, sp, c, n in points:
            if stop is not None and stop.is_set():
                raise GroupFailure("tetris profile: stopped (the caller went away)")
            seconds = _probe(group, live[:sp], c, n, seed)
            if seed:
                out.append((sp, c, n, seconds))
    return out


def _probe(group: GroupState, members: list[int], history: int, length: int, seed: int) -> float:
    """One point: seconds of the last chunk on its slowest member."""
    ring = tuple(members)
    chunks = ((PlannedChunk(history, ring),) if history else ()) + (PlannedChunk(length, ring),)
    pid = f"profile-{time.monotonic_ns()}"
    with group.lock:  # in the pool's one request order
        for m in members:
            group.to_pool(m, Probe(pid, chunks, seed))
    deadline = time.monotonic() + group.timeout_s
    with group.probe_done:
        while len(group.probes.get(pid, {})) < len(members):
            dead = [m for m in members if m in group.dead_pool]
            if dead or group.closed or time.monotonic() > deadline:
                group.probes.pop(pid, None)
                why = group.dead_pool.get(dead[0], "") if dead else "timed out or closed"
                raise GroupFailure(f"tetris profile on instances {members}: {why}")
            group.probe_done.wait(WAIT_S)
        replies = group.probes.pop(pid)
    failed = [r for r in replies.values() if isinstance(r, str)]
    if failed:
        raise GroupFailure(f"tetris profile on instances {members}: {failed[0]}")
    return max(float(r[-1]) for r in replies.values() if not isinstance(r, str))
