"""Tetris's CDSP planner (§5.1): on small pools Algorithm 1's plan has the lowest estimated TTFT
of every plan its rules allow (a brute-force enumeration, evaluated independently with Eq. (1)
and Eq. (2)); a higher improvement rate never picks a larger SP; plans obey the chunk rules."""

from __future__ import annotations

import itertools
import random
import subprocess
import sys
from collections.abc import Iterator

import pytest

from gearshift.operator.planner import native
from gearshift.operator.planner.cdsp import (
    ChunkPlan,
    PlannerRules,
    plan_request,
    single_chunk,
    sp_sizes,
)
from gearshift.operator.planner.instance_pool import Pool, get_group
from gearshift.operator.planner.latency_model import LatencyModel

Plan = list[tuple[int, tuple[int, ...]]]


def _model(sp: int, rng: random.Random | None = None) -> LatencyModel:
    """Work divides over SP; fixed and ring costs grow with it (jittered per test when rng)."""
    j = (lambda: rng.uniform(0.7, 1.3)) if rng else (lambda: 1.0)
    return LatencyModel(
        sp, 0.02 * j() + 0.01 * sp, 4e-5 * j() / sp, 4e-10 * j() / sp, 2.5e-10 * j() / sp
    )


def _rules(max_sp: int, power_of_two: bool, rng: random.Random, **kw: int) -> PlannerRules:
    return PlannerRules({s: _model(s, rng) for s in sp_sizes(max_sp, power_of_two)}, **kw)


def all_plans(
    length: int,
    history: int,
    initial: tuple[int, ...],
    sizes: tuple[int, ...],
    pool: Pool,
    chunks_left: int,
    rules: PlannerRules,
    rate: float,
) -> Iterator[Plan]:
    """Every plan Algorithm 1's rules allow, without its shortcuts: the single-chunk plan of
    Algorithm 2, and for every SP pair within its group every legal first chunk (Algorithm 3)
    followed by every plan of the rest on the queues advanced by Eq. (2)."""
    one = single_chunk(length, history, initial, sizes, pool, rules.models, rate)
    if one is None:
        return
    group0 = one[0]
    yield [(length, group0)]
    if chunks_left <= 1:
        return
    cdsp = tuple(s for s in sizes if s <= len(group0))
    inner = pool.restrict(group0)
    g = rules.chunk_granularity
    for s_cur, s_next in itertools.combinations(cdsp, 2):
        current = get_group(inner, initial, s_cur)
        following = None if current is None else get_group(inner, current, s_next)
        if current is None or following is None:
            continue
        model = rules.models[s_cur]
        fit = model.max_length(inner.wait(following) - inner.wait(current), history)
        n = length if fit >= length else int(fit // g) * g
        if n < max(g, s_cur) or n >= length:
            continue
        elapsed = inner.wait(current) + model.seconds(history, n)
        rest = tuple(s for s in cdsp if s >= s_next)
        for tail in all_plans(
            length - n,
            history + n,
            current,
            rest,
            inner.advance(elapsed),
            chunks_left - 1,
            rules,
            rate,
        ):
            yield [(n, current), *tail]


def evaluate(plan: Plan, queue: dict[int, float], rules: PlannerRules) -> float:
    """A plan's TTFT from the pool's queues at planning time: each chunk starts when its group's
    last instance is free and the previous chunk is done, and runs for Eq. (1)'s estimate."""
    clock, history = 0.0, 0
    for n, group in plan:
        clock = max(clock, max(queue[i] for i in group))
        clock += rules.models[len(group)].seconds(history, n)
        history += n
    return clock


def _random_pool(rng: random.Random, instances: int, per_node: int) -> Pool:
    busy = [rng.choice([0.0, rng.uniform(0, 4)]) for _ in range(instances)]
    return Pool.uniform(busy, per_node)


def _check_rules(plan: ChunkPlan, length: int, rules: PlannerRules) -> None:
    assert sum(c.length for c in plan.chunks) == length
    assert len(plan.chunks) <= rules.max_chunks
    for before, after in itertools.pairwise(plan.chunks):
        assert set(before.group) < set(after.group), "each group contains the previous one"
        assert before.length % rules.chunk_granularity == 0 and before.length > 0
        assert after.start >= before.end - 1e-12
    assert all(c.sp in rules.models and len(set(c.group)) == c.sp for c in plan.chunks)


@pytest.mark.parametrize(
    "search",
    [
        "python",
        pytest.param(
            "native",
            marks=pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler here"),
        ),
    ],
)
@pytest.mark.parametrize("power_of_two", [True, False])
def test_algorithm_1_finds_the_best_plan_brute_force_finds(power_of_two, search):
    rng = random.Random(1 if power_of_two else 2)
    chunked = 0
    for trial in range(120):
        instances, per_node = rng.choice([(4, 2), (4, 4), (6, 3), (8, 4), (8, 2)])
        rules = _rules(instances, power_of_two, rng, chunk_granularity=512, max_chunks=3)
        if trial % 5 == 0:  # a fit curving down outside its data: the search cuts no branch
            m = rules.models[1]
            models = {**rules.models, 1: LatencyModel(1, m.a, m.b, m.c, -1e-13)}
            rules = PlannerRules(models, chunk_granularity=512, max_chunks=3)
            assert not rules.bounded
        pool = _random_pool(rng, instances, per_node)
        length = rng.randint(1, 400) * 512 + rng.randint(0, 511)
        rate = rng.choice([0.0, 0.1, 0.3])
        plan = plan_request(length, pool, rules, rate, search)
        _check_rules(plan, length, rules)
        mine = [(c.length, c.group) for c in plan.chunks]
        assert evaluate(mine, dict(pool.queue), rules) == pytest.approx(plan.ttft, abs=1e-9)
        every = list(all_plans(length, 0, (), rules.sizes, pool, rules.max_chunks, rules, rate))
        best = min(evaluate(p, dict(pool.queue), rules) for p in every)
        assert plan.ttft == pytest.approx(best, abs=1e-9), (trial, plan, len(every))
        chunked += len(plan.chunks) > 1
    assert chunked >= 10, "the pools never made a multi-chunk plan worth it: the test is weak"


def test_a_busy_pool_splits_a_long_prompt_into_growing_chunks():
    # Fig. 3(b)'s situation: two instances free now, two more free in 2 s. One chunk on two
    # instances starts now; the rest runs on all four once they are free.
    models = {1: _model(1), 2: _model(2), 4: _model(4)}
    rules = PlannerRules(models, chunk_granularity=256, max_chunks=4)
    pool = Pool.uniform([0.0, 0.0, 2.0, 2.0], per_node=4)
    plan = plan_request(200_000, pool, rules, improvement_rate=0.0)
    assert [c.sp for c in plan.chunks] == [2, 4]
    assert plan.chunks[0].start == 0.0 and plan.chunks[0].end <= 2.0
    assert plan.chunks[1].start == pytest.approx(2.0)
    single = min(models[2].seconds(0, 200_000), models[4].seconds(0, 200_000) + 2.0)
    assert plan.ttft < single


def test_a_higher_improvement_rate_never_picks_a_larger_sp():
    rng = random.Random(5)
    rates = [0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.0]
    for _ in range(300):
        instances = rng.choice([8, 16, 32])
        rules = _rules(instances, rng.random() < 0.5, rng, chunk_granularity=1024, max_chunks=4)
        pool = _random_pool(rng, instances, 8)
        length = rng.randint(1000, 200_000)
        one = [single_chunk(length, 0, (), rules.sizes, pool, rules.models, r) for r in rates]
        sizes = [len(o[0]) for o in one if o is not None]
        assert sizes == sorted(sizes, reverse=True), sizes
        assert sizes[-1] == 1, "rate 1.0 takes no larger SP at all"
        # The full plan never uses more instances than the single-chunk group at its rate (by
        # construction), and on these cases its largest SP falls with the rate too (observed:
        # Algorithm 1 can in principle pick a smaller chunked plan at a lower rate).
        plans = [plan_request(length, pool, rules, r).chunks[-1].sp for r in rates]
        assert all(sp <= size for sp, size in zip(plans, sizes, strict=True))
        assert plans == sorted(plans, reverse=True), plans


def test_one_chunk_plans_follow_algorithm_2():
    rng = random.Random(9)
    rules = _rules(16, True, rng, chunk_granularity=1024, max_chunks=1)
    pool = _random_pool(rng, 16, 8)
    plan = plan_request(50_000, pool, rules, 0.0)
    assert len(plan.chunks) == 1
    want = min(
        pool.wait(get_group(pool, (), s)) + rules.models[s].seconds(0, 50_000) for s in rules.sizes
    )
    assert plan.ttft == pytest.approx(want)


def test_sp_sizes_and_bad_inputs_are_refused():
    assert sp_sizes(8, True) == (1, 2, 4, 8)
    assert sp_sizes(12, True) == (1, 2, 4, 8)
    assert sp_sizes(3, False) == (1, 2, 3)
    rules = PlannerRules({1: _model(1)})
    pool = Pool.uniform([0.0], 1)
    with pytest.raises(ValueError, match="prompt token"):
        plan_request(0, pool, rules, 0.3)
    with pytest.raises(ValueError, match="improvement_rate"):
        plan_request(10, pool, rules, 1.5)
    with pytest.raises(ValueError, match="at least one SP size"):
        PlannerRules({})
    with pytest.raises(ValueError, match="fits a pool"):
        plan_request(10, pool, PlannerRules({2: _model(2)}), 0.3)


def test_the_planner_never_imports_torch():
    code = (
        "import sys, gearshift.operator.planner.cdsp, gearshift.operator.planner.settings, "
        "gearshift.operator.planner.decode_placement; assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
