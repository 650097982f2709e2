"""The roofline + collective cost model: hand-computed cases are exact, more TP ranks mean less
compute and more communication, and with the presets TP decodes faster than SP at batch 1 while
SP prefills long prompts faster than TP (the direction the Shift Parallelism paper reports)."""

from __future__ import annotations

import pytest

from gearshift.operator.sim import hardware, lengths, model_desc
from gearshift.operator.sim.arrivals import Arrivals, RateCurve
from gearshift.operator.sim.hardware import Device, Hardware, Link
from gearshift.operator.sim.model_desc import ModelDesc
from gearshift.operator.sim.replica import ReplicaConfig
from gearshift.operator.sim.roofline import (
    Layout,
    LayoutError,
    RooflineCost,
    StepShape,
    all_reduce,
    all_to_all,
)
from gearshift.operator.sim.simulator import Deployment, simulate
from gearshift.operator.sim.workload import synthesize
from tests.sim.test_hardware import LLAMA3_8B

# A toy model: 1 layer, hidden 4, 1 head, FFN 4, vocab 2, fp32.
TOY = ModelDesc("toy", layers=1, hidden=4, heads=1, kv_heads=1, ffn=4, vocab=2, dtype="float32")
LINK = Link(bandwidth=100.0, latency=0.5)
TOY_HW = Hardware(Device("d", {"bf16": 1000.0}, 1e6, 10.0), 2, 2, LINK, LINK, LINK)


def test_one_rank_is_memory_bound_at_a_hand_computed_time() -> None:
    # params: 2·16 + 2·4·4 + 3·4·4 = 112 per layer, + 2·4 LM head = 120 → 480 bytes (fp32).
    assert TOY.params() == 120
    # One decode token with 9 KV tokens read + 1 written: KV = 2·1·1·4·4 = 32 bytes/token.
    shape = StepShape(tokens=1, attended=10, kv_read=9)
    nbytes = 480 + 32 * 10
    flops = 2 * 112 + 2 * 8 + 4 * 4 * 10  # weights, LM head, attention
    cost = RooflineCost(TOY, TOY_HW, Layout("one"))
    assert cost.time(shape) == pytest.approx(max(flops / 1000.0, nbytes / 10.0))
    assert cost.time(shape) == pytest.approx(80.0)  # memory bound: 800 B at 10 B/s


def test_collectives_follow_the_alpha_beta_formulas() -> None:
    assert all_reduce(400.0, 4, LINK) == pytest.approx(2 * 3 / 4 * 400 / 100 + 2 * 3 * 0.5)
    assert all_to_all(400.0, 4, LINK) == pytest.approx(3 / 4 * 400 / 100 + 3 * 0.5)
    assert all_reduce(400.0, 1, LINK) == 0.0 == all_to_all(400.0, 1, LINK)


def test_tp2_halves_the_rank_work_and_adds_two_all_reduces_per_layer() -> None:
    shape = StepShape(tokens=1, attended=10, kv_read=9)
    one = RooflineCost(TOY, TOY_HW, Layout("one")).time(shape)
    tp = RooflineCost(
        TOY.__class__(**{**TOY.__dict__, "heads": 2, "kv_heads": 2}), TOY_HW, Layout("tp", 2)
    )
    # hidden 4 with 2 heads keeps the same sizes; the rank reads half of the 800 bytes.
    comm = 2 * 1 * all_reduce(1 * 4 * 4, 2, LINK)
    assert tp.time(shape) == pytest.approx(one / 2 + comm)


def test_an_explicit_head_dim_widens_attention_and_its_weights() -> None:
    """TOY with heads of 8 (q_dim 8 over hidden 4): q, o weigh 2·4·8, k, v 2·4·8, attention
    4·8 FLOPs per attended pair, KV 2·8·4 bytes a token."""
    wide = ModelDesc("wide", 1, 4, 1, 1, 4, 2, "float32", explicit_head_dim=8)
    assert wide.layer_params() == 2 * 4 * 8 + 2 * 4 * 8 + 3 * 4 * 4
    shape = StepShape(tokens=1, attended=10, kv_read=9)
    compute_bound = Hardware(Device("d", {"bf16": 1000.0}, 1e6, 1e12), 2, 2, LINK, LINK, LINK)
    flops = 2 * wide.layer_params() + 2 * 8 + 4 * 8 * 10
    cost = RooflineCost(wide, compute_bound, Layout("one"))
    assert cost.time(shape) == pytest.approx(flops / 1000.0)


@pytest.fixture(scope="module")
def llama() -> ModelDesc:
    return model_desc.load(LLAMA3_8B)


def test_more_tp_ranks_mean_less_compute_and_more_communication(llama: ModelDesc) -> None:
    hw = hardware.load("8xH200")
    shape = StepShape(tokens=4096, attended=4096 * 2048, kv_read=4096)
    compute, comm = [], []
    for t in (1, 2, 4, 8):
        c = RooflineCost(llama, hw, Layout("tp", t))
        compute.append(c._compute(shape, t, 1, 1))
        comm.append(c.time(shape) - compute[-1])
    assert compute == sorted(compute, reverse=True) and len(set(compute)) == 4
    assert comm == sorted(comm) and len(set(comm)) == 4


def test_tp_decodes_faster_at_batch_1_and_sp_prefills_long_prompts_faster(
    llama: ModelDesc,
) -> None:
    hw = hardware.load("8xH200")
    tp, sp = RooflineCost(llama, hw, Layout("tp", 8)), RooflineCost(llama, hw, Layout("sp", 8))
    decode = StepShape(tokens=1, attended=1000, kv_read=1000)
    assert tp.time(decode) < sp.time(decode)
    n = 32768
    prefill = StepShape(tokens=n, attended=n * (n + 1) / 2, kv_read=0)
    assert sp.time(prefill) < tp.time(prefill)
    shift = RooflineCost(llama, hw, Layout("shift", 8))
    assert shift.time(decode) == tp.time(decode) and shift.time(prefill) == sp.time(prefill)
    fixed = RooflineCost(llama, hw, Layout("shift", 8), shift_threshold=10**9)
    assert fixed.time(prefill) == tp.time(prefill)


def test_illegal_layouts_are_refused(llama: ModelDesc) -> None:
    hw = hardware.load("8xH200")
    with pytest.raises(LayoutError, match="KV heads"):
        RooflineCost(llama, hardware.load("16xH200"), Layout("tp", 16))
    with pytest.raises(LayoutError, match="hardware has 8"):
        RooflineCost(llama, hw, Layout("pp", 16))
    with pytest.raises(LayoutError, match="not one of"):
        RooflineCost(llama, hw, Layout("ep", 2))


def test_the_simulator_runs_on_the_roofline_cost(llama: ModelDesc) -> None:
    p, o = lengths.Uniform(100, 1500), lengths.Uniform(10, 200)
    trace = synthesize(40, Arrivals(RateCurve.constant(4.0), cv=1.0), p, o, seed=0)
    cost = RooflineCost(llama, hardware.load("8xH200"), Layout("tp", 8))
    res = simulate(Deployment(1, ReplicaConfig(num_blocks=4096, block_size=16), cost), trace)
    assert len(res.requests) == len(trace) > 0
    assert all(0 < r.ttft < 1.0 for r in res.requests)
