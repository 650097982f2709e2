"""Tetris's CDSP prefill planner: a request's chunk plan over the prefill pool (Tetris §5.1).

Algorithm 1 starts from the best single-chunk plan (Algorithm 2), then for every pair of SP sizes
(s_current < s_next) within that plan's group cuts a first chunk whose prefill fits the time
until the next group frees up (Algorithm 3), and recurses on the rest with the pool's queues
advanced past the chunk (Eq. (2)). The plan with the lowest estimated TTFT wins.

The search runs in C++ (``cdsp_native.cpp`` through ``native.py``, the same algorithm in the
same floating-point order) when that builds, for the paper's latency bar; this module's search is
the reference and the fallback. Two exact shortcuts keep it fast in Python: a branch is skipped
when a lower bound on its TTFT already reaches the best plan found (ties keep the earlier plan,
as Algorithm 1's strict comparison does), and the groups and waits of the pair loop are computed
once per s_current.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from gearshift.operator.planner import native
from gearshift.operator.planner.instance_pool import Pool
from gearshift.operator.planner.latency_model import LatencyModel


@dataclass(frozen=True)
class Chunk:
    """One chunk of a plan: its tokens, its instance group and when it runs (seconds from now)."""

    length: int
    group: tuple[int, ...]
    start: float  # when the group is free and the chunk starts
    seconds: float  # Eq. (1) prefill estimate

    @property
    def sp(self) -> int:
        return len(self.group)

    @property
    def end(self) -> float:
        return self.start + self.seconds


@dataclass(frozen=True)
class ChunkPlan:
    """A request's chunks in order; each chunk's group contains the previous chunk's."""

    chunks: tuple[Chunk, ...]

    @property
    def ttft(self) -> float:
        """Estimated time to first token: the last chunk's end."""
        return self.chunks[-1].end


@dataclass(frozen=True)
class PlannerRules:
    """What Algorithm 1 may choose from: SP sizes with their Eq. (1) models, and chunk rules."""

    models: Mapping[int, LatencyModel]  # by SP size; the candidates are its keys
    chunk_granularity: int = 1024
    max_chunks: int = 4

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("the planner needs a latency model for at least one SP size")
        if self.chunk_granularity < 1 or self.max_chunks < 1:
            raise ValueError("chunk_granularity and max_chunks must be at least 1")

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.models))

    @property
    def bounded(self) -> bool:
        """Every coefficient >= 0: a chunk never costs less than its constant and linear terms,
        which is what the branch bound relies on."""
        return all(min(m.a, m.b, m.c, m.d) >= 0 for m in self.models.values())


# A plan while it is being searched: (TTFT relative to the search level's origin, chunks as
# (length, group, wait, seconds) with each wait relative to the previous chunk's end).
_Raw = tuple[float, tuple[tuple[int, tuple[int, ...], float, float], ...]]


def plan_request(
    length: int, pool: Pool, rules: PlannerRules, improvement_rate: float, search: str = "auto"
) -> ChunkPlan:
    """Algorithm 1 for a new request of ``length`` prompt tokens over ``pool``.

    ``search``: ``auto`` runs the C++ build once it has loaded (``native.ready``), else Python;
    ``python`` / ``native`` pick one (``native`` waits for the build and raises
    ``native.NativeBuildError`` when it cannot be built)."""
    if length < 1:
        raise ValueError(f"a request needs at least one prompt token, got {length}")
    if not 0.0 <= improvement_rate <= 1.0:
        raise ValueError(f"improvement_rate must be in [0, 1], got {improvement_rate}")
    if search not in ("auto", "python", "native"):
        raise ValueError(f"search must be auto, python or native, got {search!r}")
    pick = {"python": lambda: None, "native": native.planner, "auto": native.ready}[search]
    fn = pick()
    if fn is None and search == "native":
        raise native.NativeBuildError("the C++ CDSP planner is not available (see the log)")
    if fn is not None:
        found = native.plan(
            fn,
            length,
            pool.queue,
            pool.node_of,
            rules.models,
            rules.chunk_granularity,
            rules.max_chunks,
            improvement_rate,
        )
        raw: _Raw | None = None if found is None else (0.0, tuple(found))
    else:
        raw = python_search(length, pool, rules, improvement_rate)
    if raw is None:
        raise ValueError(f"no SP size in {rules.sizes} fits a pool of {len(pool.queue)} instances")
    chunks = []
    clock = 0.0
    for n, group, wait, seconds in raw[1]:
        chunks.append(Chunk(n, group, clock + wait, seconds))
        clock += wait + seconds
    return ChunkPlan(tuple(chunks))


def python_search(
    length: int, pool: Pool, rules: PlannerRules, improvement_rate: float
) -> _Raw | None:
    """Algorithm 1 in Python (the reference the C++ build in ``cdsp_native.cpp`` matches)."""
    return _Search(rules, improvement_rate).schedule(
        length, 0, (), rules.sizes, pool, rules.max_chunks
    )


def single_chunk(
    length: int,
    history: int,
    initial: tuple[int, ...],
    sizes: tuple[int, ...],
    pool: Pool,
    models: Mapping[int, LatencyModel],
    improvement_rate: float,
) -> tuple[tuple[int, ...], float, float] | None:
    """Algorithm 2: the group for the rest as one chunk, with its wait and prefill seconds.

    A larger SP size is taken only when it cuts the estimated TTFT by more than
    ``improvement_rate`` (line 13). Read as a rule on the whole list rather than a running
    comparison, the smallest size that no larger size beats by that margin is taken: the literal
    running comparison can pick a larger SP at a higher rate (TTFTs 10, 7.9, 6.9: rate 0.2 stops
    at 7.9, rate 0.3 skips it and takes 6.9); this reading never does.
    """
    options = []
    for s in sizes:
        found = pool.group(initial, s)
        if found is None:
            continue
        group, wait = found
        seconds = models[s].seconds(history, length)
        options.append((group, wait, seconds, wait + seconds))
    if not options:
        return None
    keep = 1.0 - improvement_rate
    pick = options[-1]
    best_after = pick[3]
    for option in reversed(options[:-1]):
        if best_after >= option[3] * keep:
            pick = option
        best_after = min(best_after, option[3])
    return pick[0], pick[1], pick[2]


class _Search:
    """One Algorithm 1 run: the rules, the improvement rate and the bound's precomputations."""

    def __init__(self, rules: PlannerRules, improvement_rate: float) -> None:
        self.models = rules.models
        self.granularity = rules.chunk_granularity
        self.rate = improvement_rate
        self.bounded = rules.bounded
        self.min_a = min(m.a for m in rules.models.values())

    def lower_bound(self, length: int, history: int, sizes: tuple[int, ...]) -> float:
        """A floor under any plan of ``length`` tokens after ``history`` on these sizes: one
        constant term, and every token's linear and history terms at the cheapest size. A model
        with a negative coefficient (a fit outside its data) gives no bound: nothing is cut."""
        if not self.bounded:
            return -math.inf
        models = self.models
        return self.min_a + length * min(models[s].b + models[s].c * history for s in sizes)

    def schedule(
        self,
        length: int,
        history: int,
        initial: tuple[int, ...],
        sizes: tuple[int, ...],
        pool: Pool,
        chunks_left: int,
    ) -> _Raw | None:
        """Algorithm 1 on ``length`` unallocated tokens after ``history`` allocated ones."""
        models = self.models
        one = single_chunk(length, history, initial, sizes, pool, models, self.rate)
        if one is None:
            return None
        group0, wait0, seconds0 = one
        best: _Raw = (wait0 + seconds0, ((length, group0, wait0, seconds0),))
        if chunks_left <= 1:
            return best
        cdsp = tuple(s for s in sizes if s <= len(group0))  # line 6
        if len(cdsp) < 2:
            return best
        inner = pool.restrict(group0)  # lines 10-11: the chunk's groups come from instance_group
        granularity = self.granularity
        for k, s_cur in enumerate(cdsp[:-1]):
            found = inner.group(initial, s_cur)  # Algorithm 3 line 6
            if found is None:
                continue
            current, wait_cur = found
            model = models[s_cur]
            # No next group waits longer than instance_group itself: if even that budget cannot
            # hold a legal chunk on s_current, no pair with it can (exact, saves the GetGroups).
            if model.max_length(wait0 - wait_cur, history) < max(granularity, s_cur):
                continue
            for s_next in cdsp[k + 1 :]:  # line 7: pairs s_current < s_next
                following = inner.group(current, s_next)  # Algorithm 3 line 7
                if following is None:
                    continue
                budget = following[1] - wait_cur  # lines 9-11
                fit = model.max_length(budget, history)
                # Line 13, rounded down to the chunk granularity (so it stays within budget).
                n = length if fit >= length else int(fit // granularity) * granularity
                if n < max(granularity, s_cur) or n >= length:  # Illegal (Algorithm 1 line 12)
                    continue
                seconds = model.seconds(history, n)
                elapsed = wait_cur + seconds
                rest = tuple(s for s in cdsp if s >= s_next)  # line 17
                if elapsed + self.lower_bound(length - n, history + n, rest) >= best[0]:
                    continue  # cannot beat the best plan so far (exact: ties keep the first)
                sub = self.schedule(
                    length - n, history + n, current, rest, inner.advance(elapsed), chunks_left - 1
                )  # lines 15-19, the queues updated by Eq. (2)
                if sub is not None and elapsed + sub[0] < best[0]:  # lines 21-22
                    best = (elapsed + sub[0], ((n, current, wait_cur, seconds), *sub[1]))
        return best


def sp_sizes(max_sp: int, power_of_two: bool) -> tuple[int, ...]:
    """SP size candidates up to ``max_sp``: powers of two (§7.1, limits fragmentation) or all."""
    if max_sp < 1:
        raise ValueError(f"max_sp must be at least 1, got {max_sp}")
    if not power_of_two:
        return tuple(range(1, max_sp + 1))
    return tuple(1 << k for k in range(int(math.log2(max_sp)) + 1))
