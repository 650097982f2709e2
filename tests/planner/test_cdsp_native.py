"""The C++ build of Algorithm 1 (``cdsp_native.cpp``) plans exactly as the Python reference:
same chunks, groups, waits and Eq. (1) seconds, over random pools (several nodes, uneven nodes,
pools restricted to some instance ids), models (including a fit with a negative coefficient,
where the branch bound is off), improvement rates, chunk limits and granularities. Also: how the
planner falls back to Python when the build fails, and what ``GEARSHIFT_PLANNER`` does."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gearshift.operator.planner import native
from gearshift.operator.planner.cdsp import PlannerRules, plan_request, sp_sizes
from gearshift.operator.planner.instance_pool import Pool
from gearshift.operator.planner.latency_model import LatencyModel

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler here")


def _model(sp: int, rng: random.Random, negative: bool) -> LatencyModel:
    def j() -> float:
        return rng.uniform(0.5, 1.5)

    d = 2.5e-10 * j() / sp
    return LatencyModel(
        sp, 0.02 * j() + 0.01 * sp, 4e-5 * j() / sp, 4e-10 * j() / sp, -d if negative else d
    )


def _case(rng: random.Random) -> tuple[int, Pool, PlannerRules, float]:
    per_node = rng.choice((1, 2, 3, 4, 8))
    instances = rng.randint(1, 40)
    node_of = tuple(i // per_node for i in range(instances))
    if rng.random() < 0.3:  # uneven nodes: move some instances onto another node
        node_of = tuple(
            n if rng.random() < 0.8 else rng.randrange(node_of[-1] + 1) for n in node_of
        )
    ids = list(range(instances))
    if rng.random() < 0.3:  # a pool of some of the deployment's instances
        ids = sorted(rng.sample(ids, rng.randint(1, instances)))
    queue = {i: 0.0 if rng.random() < 0.3 else rng.choice((rng.uniform(0, 5), 1.0)) for i in ids}
    max_sp = rng.randint(1, 32)
    negative = rng.random() < 0.15
    sizes = sp_sizes(max_sp, power_of_two=rng.random() < 0.6)
    if len(sizes) > 1 and rng.random() < 0.2:  # no SP 1: a small pool may fit no size at all
        sizes = sizes[rng.randint(1, len(sizes) - 1) :]
    rules = PlannerRules(
        {s: _model(s, rng, negative and s > 1) for s in sizes},
        chunk_granularity=rng.choice((1, 256, 1000, 1024, 4096)),
        max_chunks=rng.randint(1, 4),
    )
    length = rng.choice((rng.randint(1, 3000), rng.randint(1000, 200_000)))
    return length, Pool(queue, node_of), rules, rng.choice((0.0, 0.1, 0.3, 0.5, 1.0))


def test_the_cpp_search_plans_exactly_as_the_python_reference() -> None:
    rng = random.Random(20261123)
    compared = multi = refused = 0
    for _ in range(3000):
        length, pool, rules, rate = _case(rng)
        try:
            want = plan_request(length, Pool(pool.queue, pool.node_of), rules, rate, "python")
        except ValueError as exc:
            with pytest.raises(ValueError, match="fits a pool") as got:
                plan_request(length, pool, rules, rate, "native")
            assert str(got.value) == str(exc)
            refused += 1
            continue
        got_plan = plan_request(length, pool, rules, rate, "native")
        assert got_plan == want, (length, dict(pool.queue), pool.node_of, rules, rate)
        compared += 1
        multi += len(want.chunks) > 1
    # The cases must exercise what they claim: many plans, many of them multi-chunk.
    assert compared > 2000 and multi > 250 and refused > 10, (compared, multi, refused)


def test_bad_input_is_refused_not_planned() -> None:
    module = native.planner()
    assert module is not None
    with pytest.raises(ValueError, match="no node"):
        module.plan(100, {5: 0.0}, (0, 0), (1,), (0.1, 0.0, 0.0, 0.0), 16, 2, 0.3)
    with pytest.raises(ValueError, match="sizes or coefficients"):
        module.plan(100, {0: 0.0}, (0,), (1,), (0.1, 0.0), 16, 2, 0.3)
    with pytest.raises(ValueError, match="search must be"):
        plan_request(
            100,
            Pool({0: 0.0}, (0,)),
            PlannerRules({1: _model(1, random.Random(0), False)}),
            0.3,
            "fast",
        )


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


PLAN_ONCE = """
    from gearshift.operator.planner import native
    from gearshift.operator.planner.cdsp import PlannerRules, plan_request
    from gearshift.operator.planner.instance_pool import Pool
    from gearshift.operator.planner.latency_model import LatencyModel
    one, two = LatencyModel(1, 0.1, 1e-4, 0.0, 0.0), LatencyModel(2, 0.2, 5e-5, 0.0, 0.0)
    rules = PlannerRules({1: one, 2: two}, 256)
    plan = plan_request(4096, Pool.uniform([0.0, 0.0], 2), rules, 0.1)
    # The first plan does not wait for a build (it plans in Python meanwhile); once the build
    # is done, plans come from the loaded module.
    module = native.planner()
    assert native.ready() is module
    print("native" if module is not None else "python", plan.chunks[0].sp)
"""


def test_a_failed_build_falls_back_to_python_and_native_mode_makes_it_an_error(
    tmp_path: Path,
) -> None:
    cache = str(tmp_path / "cache")
    ok = _run(PLAN_ONCE, GEARSHIFT_PLANNER_CACHE=cache)
    assert ok.returncode == 0 and ok.stdout.split() == ["native", "2"], ok.stderr
    broken = _run(PLAN_ONCE, GEARSHIFT_PLANNER_CACHE=cache + "2", CXX="/bin/false")
    assert broken.returncode == 0 and broken.stdout.split() == ["python", "2"], broken.stderr
    assert "using the Python search" in broken.stderr
    off = _run(PLAN_ONCE, GEARSHIFT_PLANNER="python")
    assert off.returncode == 0 and off.stdout.split() == ["python", "2"], off.stderr
    required = _run(
        PLAN_ONCE, GEARSHIFT_PLANNER_CACHE=cache + "3", CXX="/bin/false", GEARSHIFT_PLANNER="native"
    )
    assert required.returncode != 0 and "required but failed" in required.stderr
    # Nothing half-written is left in a cache whose build failed.
    assert not any(p.suffix == ".tmp" for p in (tmp_path / "cache2").glob("*"))
