"""A Tetris group's own Eq. (1) latency models, measured when it starts without any (§5.1).

The paper fits the models offline from prefill latency measured over (C, L) pairs; a policy
without ``latencyModels`` would otherwise leave the router without a planner, and every prompt
would run as one chunk over the whole pool. So the group runs ``gearshift tetris-profile``'s
measurement on its own pool before it serves (``probes.profile_running_pool``: a C-token then an
L-token chunk on the first s live instances, for every SP size s), fits Eq. (1) per size and
reports the models in ``WorkerStats.tetris_models``, where the router's planner takes them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gearshift.v1 import policy_pb2, worker_pb2
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.policies.tetris.latency_fit import fit_eq1, relative_rms

REPEATS = 2  # runs of each point; the fastest is kept (load on a shared host only adds time)
MIN_TOKENS = 8  # C + L: three distinct lengths (tokens/8, /4, /2) and two histories
FIELD = "policy.tetris.autoProfileTokens"

# What the fit needs from the group: ``TetrisGroup.profile`` (sizes, histories, lengths, repeats)
# returning (sp, C, L, seconds) rows.
Profile = Callable[
    [Sequence[int], Sequence[int], Sequence[int], int], list[tuple[int, int, int, float]]
]


@dataclass(frozen=True)
class Grid:
    """The (C, L) points measured for every SP size."""

    histories: tuple[int, ...]
    lengths: tuple[int, ...]

    @staticmethod
    def for_tokens(tokens: int) -> Grid:
        """Histories 0 and tokens/2, lengths tokens/8, /4 and /2: C + L reaches ``tokens``,
        and Eq. (1)'s four terms are told apart (L² from L, C·L from L)."""
        return Grid((0, tokens // 2), (tokens // 8, tokens // 4, tokens // 2))


def profile_tokens(tetris: policy_pb2.TetrisPolicy, max_model_len: int) -> int:
    """The C + L bound of the start-up grid, 0 when there is none to run (models configured,
    or ``autoProfileTokens: 0``); InvalidRequestError naming the field for a value the model
    cannot run."""
    if tetris.latency_models:
        return 0
    if not tetris.HasField("auto_profile_tokens"):
        tokens = min(max_model_len, 4 * int(tetris.chunk_granularity))
        return tokens if tokens >= MIN_TOKENS else 0
    tokens = int(tetris.auto_profile_tokens)
    if tokens and not MIN_TOKENS <= tokens <= max_model_len:
        raise InvalidRequestError(
            FIELD,
            f"{FIELD}: {tokens} tokens; the start-up profile needs at least {MIN_TOKENS} and at "
            f"most the model's {max_model_len} positions (0 turns it off)",
        )
    return tokens


def fit_pool(profile: Profile, tokens: int) -> worker_pb2.TetrisModelStatus:
    """Measure the pool on ``Grid.for_tokens(tokens)`` for every SP size it can run and fit
    Eq. (1) per size; the status says AUTO_FITTED with the models, or NONE with why a fit
    failed (GroupFailure from the pool propagates)."""
    grid = Grid.for_tokens(tokens)
    started = time.monotonic()
    rows = profile([], grid.histories, grid.lengths, REPEATS)
    seconds = time.monotonic() - started
    fastest: dict[tuple[int, int, int], float] = {}
    for sp, history, length, secs in rows:
        key = (sp, history, length)
        fastest[key] = min(secs, fastest.get(key, secs))
    by_sp: dict[int, list[tuple[float, float, float]]] = {}
    for (sp, history, length), secs in sorted(fastest.items()):
        by_sp.setdefault(sp, []).append((float(history), float(length), secs))
    status = worker_pb2.TetrisModelStatus(
        samples=len(rows), profile_seconds=seconds, source=worker_pb2.TetrisModelStatus.NONE
    )
    try:
        fits = {sp: fit_eq1(samples) for sp, samples in by_sp.items()}
    except ValueError as exc:
        status.message = f"the start-up profile could not be fitted: {exc}"
        return status
    for sp, coeffs in sorted(fits.items()):
        a, b, c, d = coeffs
        status.models.add(sp=sp, a=a, b=b, c=c, d=d)
        status.fit_rms_error[sp] = relative_rms(coeffs, by_sp[sp])
    status.source = worker_pb2.TetrisModelStatus.AUTO_FITTED
    status.message = (
        f"fitted at start for SP sizes {sorted(fits)} from {len(rows)} samples "
        f"(C in {list(grid.histories)}, L in {list(grid.lengths)}) in {seconds:.1f} s"
    )
    return status


def off_status(why: str) -> worker_pb2.TetrisModelStatus:
    """No models: the group plans each prompt itself, as one chunk over its pool."""
    return worker_pb2.TetrisModelStatus(source=worker_pb2.TetrisModelStatus.NONE, message=why)
