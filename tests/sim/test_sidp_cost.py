"""SiDP in the simulator (issue 16; SiDP §3–4): its memory from the engine's formula, WaS vs CaS
step costs, and its `gearshift plan` candidates."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from gearshift.operator.sim import hardware, model_desc
from gearshift.operator.sim.candidates import PlanSettings, enumerate_candidates
from gearshift.operator.sim.roofline import Layout, RooflineCost, StepShape
from gearshift.operator.sim.sidp_cost import SidpCost, b_th, rank_bytes
from gearshift.v1 import policy_pb2
from gearshift.worker.policies import checks
from gearshift.worker.policies.support import check_runnable

FIXTURES = Path(__file__).parent / "fixtures"
LLAMA_70B = FIXTURES / "llama3_70b_config.json"


def _decode(batch: int, context: int = 1024) -> StepShape:
    return StepShape(tokens=batch, attended=float(batch * context), kv_read=float(batch * context))


def test_sharing_the_ffn_frees_kv_for_llama_70b_at_tp2_dp4() -> None:
    """SiDP §5 (Fig. 5): ~1.7x the KV tokens of vLLM's DP+TP at TP 2 x DP 4. On H200 (141 GB
    at 0.9 utilisation) the engine's own weight formula gives that ratio."""
    model, hw = model_desc.load(LLAMA_70B), hardware.load("8xH200")
    cands = {c.name: c for c in enumerate_candidates(model, hw, PlanSettings())}
    plain = 4 * cands["tp2x4"].kv_tokens  # four TP-2 groups, each holding all the weights
    shared = cands["sidp2x4"].kv_tokens  # one group of 4 replicas sharing the FFN
    assert 1.5 < shared / plain < 1.9
    # TP 1: no static layout fits 70B on one GPU, every SiDP replica holds 1/8 of the FFN.
    assert "one" not in cands and "one x8" not in cands
    assert cands["sidp1x8"].kv_tokens > 1_000_000
    assert rank_bytes(model, 8, 1).resident < hw.device.memory_bytes


def test_was_wins_large_batches_and_cas_small_ones() -> None:
    model, hw = model_desc.load(LLAMA_70B), hardware.load("8xH200")
    cost = SidpCost(model, hw, dp=4, tp=2)
    base = RooflineCost(model, hardware.with_count(hw, 2), Layout("tp", 2))
    small, large = _decode(1), StepShape(8192, 8192.0 * 4096, 8192.0 * 4096)
    assert cost.cas(small) < cost.was(small) and cost.time(small) == cost.cas(small)
    assert cost.was(large) < cost.cas(large) and cost.time(large) == cost.was(large)
    for s in (small, _decode(64), large):
        assert cost.time(s) >= base.time(s)  # remote weights never come for free
    # Prefetch hides the fetches behind compute once a step is big enough: WaS == the TP step.
    assert cost.was(large) == pytest.approx(base.time(large))
    assert cost.remote_layers == 80 - 20


def test_sidp_candidates_fit_one_node_and_the_engine_runs_their_policies() -> None:
    model, hw = model_desc.load(LLAMA_70B), hardware.load("16xH200")  # two nodes of 8
    cands = [c for c in enumerate_candidates(model, hw, PlanSettings()) if c.kind == "sidp"]
    assert cands
    for c in cands:
        assert c.gpus_per_group <= hw.devices_per_node
        dp, tp = c.policy["sidp"]["dp"], c.policy["sidp"]["tp"]
        assert c.replicas == hw.count // (dp * tp) * dp  # every engine replica is routed to
        policy = policy_pb2.Policy()
        policy.sidp.dp, policy.sidp.tp = dp, tp
        assert checks.layout_errors(policy, c.gpus_per_group) == []
        assert check_runnable(policy, c.gpus_per_group).kind == "sidp"
    with pytest.raises(ValueError, match="one node"):
        SidpCost(model, hw, dp=4, tp=4)


def test_b_th_is_where_the_forward_hides_the_fetches() -> None:
    model, hw = model_desc.load(LLAMA_70B), hardware.load("8xH200")
    th = b_th(model, hw, dp=4, tp=2)
    assert th.tokens is not None and th.tokens > 1
    cost = SidpCost(model, hw, dp=4, tp=2)
    at, below = _decode(th.tokens), _decode(th.tokens - 1)
    assert cost.was(at) == pytest.approx(cost._base.time(at))  # hidden from B_th on
    assert cost.was(below) > cost._base.time(below)
    # A faster link hides the fetches sooner; a slower one needs a bigger batch.
    fast = replace(hw, intra_node=replace(hw.intra_node, bandwidth=hw.intra_node.bandwidth * 4))
    slow = replace(hw, intra_node=replace(hw.intra_node, bandwidth=hw.intra_node.bandwidth / 4))
    fast_th, slow_th = b_th(model, fast, 4, 2), b_th(model, slow, 4, 2)
    assert fast_th.tokens is not None and slow_th.tokens is not None
    assert fast_th.tokens < th.tokens < slow_th.tokens
    # A link so slow nothing hides it (TP 1: the forward itself never uses the link): no
    # threshold, and the reason says why.
    crawl = replace(hw, intra_node=replace(hw.intra_node, bandwidth=1.0))
    none = b_th(model, crawl, 8, 1)
    assert none.tokens is None and "never hides" in none.reason


def test_measured_was_cost_adds_fetches_on_a_shared_core_and_overlaps_them_otherwise() -> None:
    """``MeasuredWasCost``: a profiled step plus the pass's remote-layer fetches, summed where
    the housekeeper shares the replica's core (CPU), max'ed where copies have their own engine."""
    from gearshift.operator.sim.sidp_cost import MeasuredWasCost
    from gearshift.worker.engine.scheduler import ScheduledBatch

    class Flat:
        def step_time(self, batch: ScheduledBatch) -> float:
            return 0.010

    batch = ScheduledBatch()
    summed = MeasuredWasCost(Flat(), remote_layers=3, fetch_seconds=0.002, overlap=False)
    assert summed.step_time(batch) == pytest.approx(0.016)
    overlapped = replace(summed, overlap=True)
    assert overlapped.step_time(batch) == pytest.approx(0.010)  # the fetches hide behind compute
    slow_link = replace(overlapped, fetch_seconds=0.005)
    assert slow_link.step_time(batch) == pytest.approx(0.015)  # or compute waits for them
