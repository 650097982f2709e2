"""The simulator runs the engine's own scheduler against simulated time: a hand-computed case is
exact, runs are deterministic, KV exhaustion preempts as the scheduler does, the router's rule
spreads load, and over-long requests are refused, not dropped."""

from __future__ import annotations

import numpy as np
import pytest

from gearshift.operator.sim import lengths
from gearshift.operator.sim.arrivals import Arrivals, RateCurve
from gearshift.operator.sim.cost_model import LinearFit, StepCostModel
from gearshift.operator.sim.replica import ReplicaConfig
from gearshift.operator.sim.simulator import Deployment, simulate
from gearshift.operator.sim.trace import TraceRequest
from gearshift.operator.sim.workload import synthesize

COST = StepCostModel(prefill=LinearFit(0.1, 0.01, 0.0), decode=LinearFit(0.05, 0.0, 0.001))


def _deploy(replicas: int = 1, **cfg: int) -> Deployment:
    config = ReplicaConfig(**{"num_blocks": 256, "block_size": 16, **cfg})
    return Deployment(replicas, config, COST)


def test_one_request_has_the_hand_computed_ttft_and_tpot() -> None:
    res = simulate(_deploy(), [TraceRequest(2.0, 10, 4)])
    (r,) = res.requests
    # Prefill of 10 tokens: 0.1 + 0.01·10 = 0.2 s. Decodes attend 11, 12, 13 positions:
    # 0.05 + 0.001·11, ... → 0.061, 0.062, 0.063 s.
    assert r.token_times == pytest.approx([2.2, 2.261, 2.323, 2.386])
    assert r.ttft == pytest.approx(0.2)
    assert r.tpot == pytest.approx(0.062)
    assert r.e2e == pytest.approx(0.386)
    assert res.steps == [4] and res.preemptions == 0


def test_a_long_prompt_is_chunked_under_the_token_budget() -> None:
    res = simulate(_deploy(max_num_batched_tokens=8), [TraceRequest(0.0, 20, 1)])
    # Chunks 8, 8, 4: 0.18 + 0.18 + 0.14; the last chunk samples the only token.
    assert res.requests[0].token_times == pytest.approx([0.5])
    assert res.steps == [3]


def test_the_same_trace_gives_the_same_result_and_every_token_is_produced() -> None:
    p, o = lengths.Uniform(20, 300), lengths.Uniform(1, 40)
    trace = synthesize(150, Arrivals(RateCurve.constant(4.0), cv=2.0), p, o, seed=9)
    deploy = _deploy(replicas=2, num_blocks=64, max_num_batched_tokens=256)
    a, b = simulate(deploy, trace), simulate(deploy, trace)
    assert [r.token_times for r in a.requests] == [r.token_times for r in b.requests]
    assert a.summary() == b.summary()
    assert [len(r.token_times) for r in a.requests] == [t.output_tokens for t in trace]
    for r, t in zip(a.requests, trace, strict=True):
        assert r.arrival == t.arrival_s and r.ttft > 0
        assert np.all(np.diff(r.token_times) > 0)
    assert a.output_throughput > 0 and a.summary()["requests"] == 150


def test_kv_exhaustion_preempts_the_youngest_request_which_recomputes() -> None:
    # 10 blocks of 4 tokens; each request grows to 12 + 20 = 32 tokens (8 blocks): both fit
    # at first, not at the end, so the younger one is preempted and recomputed later.
    deploy = _deploy(num_blocks=10, block_size=4)
    res = simulate(deploy, [TraceRequest(0.0, 12, 20), TraceRequest(0.0, 12, 20)])
    old, young = res.requests
    assert res.preemptions >= 1
    assert old.preemptions == 0 and young.preemptions >= 1
    assert len(old.token_times) == len(young.token_times) == 20
    assert young.finished > old.finished
    # Without pressure nobody is preempted and both finish together.
    roomy = simulate(_deploy(num_blocks=64, block_size=4), [TraceRequest(0.0, 12, 20)] * 2)
    assert roomy.preemptions == 0
    assert roomy.requests[0].finished == roomy.requests[1].finished < young.finished


def test_requests_go_to_the_replica_with_the_fewest_outstanding_tokens() -> None:
    trace = [TraceRequest(0.0, 500, 50), TraceRequest(0.0, 10, 5), TraceRequest(0.0, 10, 5)]
    res = simulate(_deploy(replicas=2), trace)
    # The long request loads one replica (the round robin's first); both short ones go to the
    # other.
    long, short1, short2 = (r.replica for r in res.requests)
    assert short1 == short2 != long


def test_requests_longer_than_the_context_are_refused_with_a_reason() -> None:
    trace = [TraceRequest(0.0, 10, 5), TraceRequest(0.1, 2000, 100)]
    res = simulate(_deploy(max_model_len=1024), trace)
    assert len(res.requests) == 1
    assert res.rejected == [(1, "2000 + 100 tokens exceed 1024")]


def test_a_request_that_can_never_fit_the_kv_cache_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="more KV blocks"):
        simulate(_deploy(num_blocks=2, block_size=4), [TraceRequest(0.0, 30, 2)])
