"""Algorithm 1 (Tetris §5.1) against an exhaustive enumeration of every plan on small cases.

Everything here is written from the paper, not from the planner's modules: the enumeration
(every split of the prompt into chunks x every chain of growing instance groups), the cost of a
plan (Eq. (1) per chunk, each chunk starting when its group is free and the previous chunk is
done, which is what Eq. (2)'s queue update encodes), GetGroup (§5.1's two cases), Algorithm 2's
improvement-rate rule and Algorithm 3's chunk length (found by walking chunk lengths and
evaluating Eq. (1), not by solving it). Only ``plan_request`` is called from the planner.

Two spaces are searched:

* every structurally legal plan: up to ``max_chunks`` chunks on strictly growing SP sizes from
  the candidates, each group containing the previous one, every chunk but the last a positive
  multiple of the chunk granularity and at least its SP size. Algorithm 1 is a heuristic over
  this space: its plan is in it and never beats its optimum, and on some small cases it is
  worse, for the reasons the paper builds in (line 6: no chunk uses more instances than the
  single-chunk plan picked; Algorithm 3: a chunk is cut to end before the next group is free,
  never to overrun it; GetGroup: groups stay on as few nodes as they can, not on the instances
  that free up first). The test counts those cases and checks each one's optimum breaks one of
  those rules.
* the plans those rules allow (the predicate ``allowed``, checked on each enumerated plan):
  Algorithm 1's estimated TTFT equals this space's optimum on every case, and its plan is the
  optimum wherever the optimum is unique.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import pytest

from gearshift.operator.planner import native
from gearshift.operator.planner.cdsp import PlannerRules, plan_request
from gearshift.operator.planner.instance_pool import Pool
from gearshift.operator.planner.latency_model import LatencyModel

Coeffs = tuple[float, float, float, float]  # Eq. (1)'s a, b, c, d
Plan = tuple[tuple[int, frozenset[int]], ...]  # (tokens, instance group) per chunk


@dataclass(frozen=True)
class Case:
    length: int
    queue: tuple[float, ...]  # T_k of instance k
    node: tuple[int, ...]  # node of instance k
    models: Mapping[int, Coeffs]  # by SP size; the candidates are its keys
    granularity: int
    max_chunks: int
    rate: float

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.models))


def eq1(m: Coeffs, history: int, n: int) -> float:
    """T_s = a + b·L + c·(C·L) + d·L² (Eq. (1)), L = n chunk tokens after C = history."""
    a, b, c, d = m
    return a + b * n + c * history * n + d * n * n


def ttft(plan: Plan, case: Case) -> float:
    """Chunks run in order; each starts once its group's last instance is free and the previous
    chunk has ended, and lasts Eq. (1) over the tokens before it."""
    clock, history = 0.0, 0
    for n, group in plan:
        clock = max(clock, max(case.queue[i] for i in group))
        clock += eq1(case.models[len(group)], history, n)
        history += n
    return clock


# ---- the full space ----------------------------------------------------------------------------


def _lengths(total: int, sizes: Sequence[int], granularity: int) -> Iterator[tuple[int, ...]]:
    """Chunk lengths for chunks of these SP sizes: every chunk but the last a multiple of the
    granularity and at least its SP size; the last the rest (at least one token)."""
    if len(sizes) == 1:
        yield (total,)
        return
    for n in range(granularity, total, granularity):
        if n >= sizes[0]:
            for rest in _lengths(total - n, sizes[1:], granularity):
                yield (n, *rest)


def _chains(instances: int, sizes: Sequence[int]) -> Iterator[tuple[frozenset[int], ...]]:
    """Every chain of groups of these sizes, each containing the one before."""
    if not sizes:
        yield ()
        return

    def grow(prev: frozenset[int], i: int) -> Iterator[tuple[frozenset[int], ...]]:
        if i == len(sizes):
            yield ()
            return
        others = [k for k in range(instances) if k not in prev]
        for extra in itertools.combinations(others, sizes[i] - len(prev)):
            group = prev | frozenset(extra)
            for tail in grow(group, i + 1):
                yield (group, *tail)

    yield from grow(frozenset(), 0)


def every_plan(case: Case) -> Iterator[Plan]:
    """Every structurally legal plan of the case."""
    n = len(case.queue)
    usable = [s for s in case.sizes if s <= n]
    for k in range(1, case.max_chunks + 1):
        for sizes in itertools.combinations(usable, k):
            for lengths in _lengths(case.length, sizes, case.granularity):
                for groups in _chains(n, sizes):
                    yield tuple(zip(lengths, groups, strict=True))


# ---- the rules of Algorithms 1-3 ---------------------------------------------------------------


def get_group(
    queue: Mapping[int, float], node: Sequence[int], initial: frozenset[int], size: int
) -> frozenset[int] | None:
    """GetGroup (§5.1): first the shortest-queued instances of the nodes ``initial`` uses; then,
    on the other nodes, the node with the shortest ``need``-th queue if one node can hold the
    rest, else whole nodes (the one whose last instance frees first; ties: the larger node, the
    lower id) until one can. Ties between instances go to the lower id."""
    need = size - len(initial)
    if need < 0:
        return None
    group = set(initial)
    used = {node[i] for i in initial}
    by_wait = sorted(queue, key=lambda i: (queue[i], i))
    same = [i for i in by_wait if node[i] in used and i not in group][:need]
    group.update(same)
    need -= len(same)
    free = {node[i] for i in queue} - used
    while need:
        members = {m: [i for i in by_wait if node[i] == m] for m in free}
        fits = [m for m in free if len(members[m]) >= need]
        if fits:
            best = min(fits, key=lambda m: (queue[members[m][need - 1]], m))
            group.update(members[best][:need])
            return frozenset(group)
        if not free:
            return None
        whole = min(free, key=lambda m: (queue[members[m][-1]], -len(members[m]), m))
        group.update(members[whole])
        need -= len(members[whole])
        free.discard(whole)
    return frozenset(group)


def wait(queue: Mapping[int, float], group: frozenset[int]) -> float:
    return max(queue[i] for i in group)


def single_chunk(
    case: Case,
    length: int,
    history: int,
    initial: frozenset[int],
    sizes: Sequence[int],
    queue: Mapping[int, float],
) -> frozenset[int] | None:
    """Algorithm 2 with the planner's documented reading of line 13: the smallest SP size that
    no larger size beats by more than the improvement rate."""
    options = []
    for s in sizes:
        group = get_group(queue, case.node, initial, s)
        if group is not None:
            options.append((group, wait(queue, group) + eq1(case.models[s], history, length)))
    keep = 1.0 - case.rate
    for i, (group, t) in enumerate(options):
        if all(later >= t * keep for _, later in options[i + 1 :]):
            return group
    return None


def chunk_length(case: Case, m: Coeffs, history: int, budget: float, total: int) -> int:
    """Algorithm 3 line 13 by walking: the whole rest if it fits the budget, else the longest
    multiple of the granularity whose Eq. (1) time fits (0 if none)."""
    if eq1(m, history, total) <= budget:
        return total
    best = 0
    for n in range(case.granularity, total, case.granularity):
        if eq1(m, history, n) <= budget:
            best = n
    return best


def allowed(
    plan: Plan,
    case: Case,
    length: int,
    history: int,
    initial: frozenset[int],
    sizes: Sequence[int],
    queue: Mapping[int, float],
    chunks_left: int,
) -> bool:
    """Whether Algorithm 1's rules allow ``plan`` for ``length`` tokens after ``history``."""
    cap = single_chunk(case, length, history, initial, sizes, queue)
    if cap is None:
        return False
    (n, group), rest = plan[0], plan[1:]
    if not rest:
        return n == length and group == cap  # line 3-4: the single-chunk plan
    if chunks_left <= 1 or any(not g <= cap for _, g in plan):  # line 6: within its group
        return False
    cdsp = [s for s in sizes if s <= len(cap)]
    inside = {i: queue[i] for i in cap}
    s_cur = len(group)
    if s_cur not in cdsp or get_group(inside, case.node, initial, s_cur) != group:
        return False
    if not max(case.granularity, s_cur) <= n < length:  # line 12: illegal chunk lengths
        return False
    start = wait(inside, group)
    m = case.models[s_cur]
    for s_next in (s for s in cdsp if s_cur < s <= len(rest[0][1])):  # line 7 and line 17
        following = get_group(inside, case.node, group, s_next)
        if following is None:
            continue
        if chunk_length(case, m, history, wait(inside, following) - start, length) != n:
            continue
        elapsed = start + eq1(m, history, n)
        later = {i: max(0.0, t - elapsed) for i, t in inside.items()}  # Eq. (2)
        rest_sizes = [s for s in cdsp if s >= s_next]
        if allowed(rest, case, length - n, history + n, group, rest_sizes, later, chunks_left - 1):
            return True
    return False


# ---- cases -------------------------------------------------------------------------------------

# Coefficient sets, per SP size s (a, b, c, d): compute that divides over the ring with a fixed
# cost that grows with it; attention-heavy; a ring whose overhead eats the gain; linear only.
MODEL_SETS: dict[str, Mapping[int, Coeffs]] = {
    "divides": {s: (0.002 + 0.002 * s, 0.01 / s, 2e-4 / s, 3e-4 / s) for s in (1, 2, 3)},
    "attention": {s: (0.001 * s, 0.002 / s, 2e-3 / s, 2e-3 / s) for s in (1, 2, 3)},
    "ring-costly": {s: (0.03 * s, 0.012 / s**0.5, 1e-4, 1e-4 / s) for s in (1, 2, 3)},
    "linear": {s: (0.004, 0.01 / s, 0.0, 0.0) for s in (1, 2, 3)},
}


def cases(seed: int, count: int) -> Iterator[Case]:
    rng = random.Random(seed)
    for _ in range(count):
        instances = rng.choice((1, 2, 2, 3, 3, 3))
        per_node = rng.choice(sorted({1, 2, instances}))
        base = MODEL_SETS[rng.choice(sorted(MODEL_SETS))]
        jitter = {s: tuple(v * rng.uniform(0.8, 1.25) for v in base[s]) for s in base}
        sizes = rng.choice(((1, 2, 3), (1, 2, 3), (1, 2), (1, 3), (1,), (2, 3)))
        sizes = tuple(s for s in sizes if s <= instances) or (1,)
        yield Case(
            length=rng.randint(1, 40),
            queue=tuple(rng.choice((0.0, rng.uniform(0.0, 0.4))) for _ in range(instances)),
            node=tuple(i // per_node for i in range(instances)),
            models={s: jitter[s] for s in sizes},  # type: ignore[misc]
            granularity=rng.choice((1, 2, 3, 4)),
            max_chunks=rng.choice((1, 2, 3, 3)),
            rate=rng.choice((0.0, 0.0, 0.1, 0.3)),
        )


def algorithm_1(case: Case, search: str) -> tuple[Plan, float]:
    rules = PlannerRules(
        {s: LatencyModel(s, *case.models[s]) for s in case.sizes},
        chunk_granularity=case.granularity,
        max_chunks=case.max_chunks,
    )
    pool = Pool(dict(enumerate(case.queue)), case.node)
    plan = plan_request(case.length, pool, rules, case.rate, search)
    return tuple((c.length, frozenset(c.group)) for c in plan.chunks), plan.ttft


SEARCHES = [
    "python",
    pytest.param(
        "native", marks=pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler")
    ),
]


@pytest.mark.parametrize("search", SEARCHES)
def test_algorithm_1_is_the_optimum_of_the_plans_its_rules_allow(search):
    chunked = unique = 0
    for i, case in enumerate(cases(seed=29, count=600)):
        mine, estimate = algorithm_1(case, search)
        assert ttft(mine, case) == pytest.approx(estimate, rel=1e-12, abs=1e-15), (i, case)
        queue = dict(enumerate(case.queue))
        rule_plans = [
            p
            for p in every_plan(case)
            if allowed(p, case, case.length, 0, frozenset(), case.sizes, queue, case.max_chunks)
        ]
        assert mine in rule_plans, (i, case, mine)
        costs = sorted((ttft(p, case), p) for p in rule_plans)
        best = costs[0][0]
        assert estimate == pytest.approx(best, rel=1e-12, abs=1e-15), (i, case, mine, costs[0])
        if len(costs) == 1 or costs[1][0] > best * (1 + 1e-9):
            unique += 1
            assert mine == costs[0][1], (i, case)
        chunked += len(mine) > 1
    # The cases must exercise chunking and the plan comparison, or the test proves little.
    assert chunked >= 30, chunked
    assert unique >= 300, unique


@pytest.mark.parametrize("search", SEARCHES)
def test_algorithm_1_never_beats_the_full_space_and_misses_it_only_by_its_rules(search):
    better = 0
    for i, case in enumerate(cases(seed=7, count=600)):
        mine, estimate = algorithm_1(case, search)
        plans = list(every_plan(case))
        assert mine in plans, (i, case, mine)
        best_plan = min(plans, key=lambda p: ttft(p, case))
        best = ttft(best_plan, case)
        assert best <= estimate * (1 + 1e-12) + 1e-15, (i, case)
        if best < estimate * (1 - 1e-9):
            better += 1
            # The optimum lies outside the rules: it uses more instances than the single-chunk
            # group (line 6), a non-last chunk overruns the time the next group frees up
            # (Algorithm 3), or a group is not GetGroup's (which keeps a ring on few nodes).
            queue = dict(enumerate(case.queue))
            assert not allowed(
                best_plan, case, case.length, 0, frozenset(), case.sizes, queue, case.max_chunks
            )
            cap = single_chunk(case, case.length, 0, frozenset(), case.sizes, queue)
            assert cap is not None
            overruns = any(
                ttft(best_plan[: k + 1], case) > wait(queue, best_plan[k + 1][1]) + 1e-15
                for k in range(len(best_plan) - 1)
            )
            inside = {k: queue[k] for k in cap}
            groups = [frozenset[int](), *(g for _, g in best_plan)]
            not_getgroup = any(
                not after <= cap or get_group(inside, case.node, before, len(after)) != after
                for before, after in itertools.pairwise(groups)
            )
            assert not best_plan[-1][1] <= cap or overruns or not_getgroup, (i, case, best_plan)
    # Algorithm 1 is a heuristic: the full space beats it on some cases (131 of these 600,
    # cases drawn to make chunking likely).
    assert better > 0, better


def test_a_single_chunk_cap_hides_a_better_growing_plan():
    # Instance 1 frees at 0.25 s, instance 0 now: one chunk is best on instance 0 alone (SP 2
    # would wait), so line 6 allows no SP 2 chunk; yet starting on 0 and finishing on {0, 1}
    # once 1 is free beats it. The exhaustive search finds it; Algorithm 1 by design does not.
    models = {1: (0.001, 0.01, 0.0, 0.0), 2: (0.002, 0.005, 0.0, 0.0)}
    case = Case(40, (0.0, 0.25), (0, 0), models, 1, 2, 0.0)
    mine, estimate = algorithm_1(case, "python")
    assert mine == ((40, frozenset({0})),)
    best = min(every_plan(case), key=lambda p: ttft(p, case))
    assert [len(g) for _, g in best] == [1, 2]
    assert ttft(best, case) < estimate
