"""Tetris in the simulator (issue 16; Tetris §3.2, §4–5): the router's planner on the prefill
pool, the hand-off, and decode instances whose leader is the engine's own DecodeAdmission."""

from __future__ import annotations

import dataclasses

import pytest

from gearshift.operator.planner.cdsp import PlannerRules, plan_request
from gearshift.operator.planner.instance_pool import Pool
from gearshift.operator.sim import hardware, model_desc
from gearshift.operator.sim.candidates import PlanSettings, enumerate_candidates
from gearshift.operator.sim.planning import plan_deployment, simulate_point
from gearshift.operator.sim.replica import ReplicaConfig
from gearshift.operator.sim.roofline import Layout, RooflineCost
from gearshift.operator.sim.tetris_sim import (
    RECEIVE_STEP_S,
    TetrisGroupSim,
    simulate_groups,
    simulate_tetris,
)
from gearshift.operator.sim.trace import TraceRequest
from gearshift.operator.sim.traffic import Traffic
from gearshift.worker.policies.registry import make_policy

LLAMA_8B = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "torch_dtype": "bfloat16",
}


def _model() -> model_desc.ModelDesc:
    return model_desc.from_config(LLAMA_8B, "8b")


def _candidates() -> list:
    settings = PlanSettings(max_model_len=131072)
    return enumerate_candidates(_model(), hardware.preset("8xH200"), settings, {"tetris"})


def test_candidates_fill_the_node_and_render_a_policy_the_engine_takes() -> None:
    cands = _candidates()
    names = {c.name for c in cands}
    assert {"tetris7p1x1", "tetris4p1x4", "tetris4p2x2"} <= names
    assert "tetris0p1x8" not in names and all(c.gpus_per_group == 8 for c in cands)
    for c in cands:
        policy = make_policy(c.policy, 8)  # refuses a layout or field the engine cannot run
        msg = policy.message
        assert msg.prefill_instances + msg.decode_instances * msg.decode_tp == 8
        assert msg.prefill_instances >= 2
        # The fitted Eq. (1) models go along, one per SP size the planner may pick.
        assert sorted(m.sp for m in msg.latency_models) == [
            s for s in (1, 2, 4, 8) if s <= msg.prefill_instances
        ]
    # 70B in bf16 does not fit one GPU: its prefill instances are TP 2 on H100s (80 GB), the
    # pool's Eq. (1) fitted for TP-2 instances, and the policy takes them.
    big = model_desc.from_config(
        {**LLAMA_8B, "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
         "intermediate_size": 28672},
        "70b",
    )  # fmt: skip
    cands = enumerate_candidates(big, hardware.preset("8xH100"), PlanSettings(), {"tetris"})
    assert cands and all(c.policy["tetris"]["prefillTp"] >= 2 for c in cands)
    for c in cands:
        t = c.policy["tetris"]
        ranks = t["prefillInstances"] * t["prefillTp"] + t["decodeInstances"] * t["decodeTp"]
        assert ranks == 8 and make_policy(c.policy).world_size == 8
    traffic = Traffic.from_mapping(
        {"rate": 1, "prompt": {"fixed": 8000}, "output": {"fixed": 8}, "requests": 8}
    )
    assert simulate_point(cands[0], traffic, 1.0, None)["requests"] == 8
    # Nothing at all fits a TP-8 instance of a 4x larger model.
    huge = model_desc.from_config(
        {**LLAMA_8B, "hidden_size": 16384, "num_hidden_layers": 160, "num_attention_heads": 128,
         "intermediate_size": 53248},
        "huge",
    )  # fmt: skip
    assert enumerate_candidates(huge, hardware.preset("8xH100"), PlanSettings(), {"tetris"}) == []


def _group(prefill: int = 4) -> TetrisGroupSim:
    model, hw = _model(), hardware.preset("8xH200")
    cand = next(c for c in _candidates() if c.name == f"tetris{prefill}p1x4")
    msg = make_policy(cand.policy, 8).message
    from gearshift.operator.planner.latency_model import LatencyModel

    rules = PlannerRules(
        {m.sp: LatencyModel(m.sp, m.a, m.b, m.c, m.d) for m in msg.latency_models}, 1024, 4
    )
    link = hw.link(8)
    return TetrisGroupSim(
        prefill,
        1,
        rules,
        0.3,
        ReplicaConfig(num_blocks=20000, block_size=16, max_model_len=131072),
        RooflineCost(model, hardware.with_count(hw, 4), Layout("tp", 4)),
        model.kv_bytes_per_token(),
        link.bandwidth,
        link.latency,
    )


def test_one_request_gets_its_first_token_one_decode_step_after_the_hand_off() -> None:
    # A buffer that holds each member's rows: one piece per member, all at once.
    group = dataclasses.replace(_group(), transfer_buffer_bytes=1 << 40)
    trace = [TraceRequest(arrival_s=1.0, prompt_tokens=8000, output_tokens=3)]
    result = simulate_tetris(group, trace)
    (req,) = result.requests
    plan = plan_request(8000, Pool.uniform([0.0] * 4, 8), group.rules, 0.3)
    landed = plan.ttft + group.handoff_s(8000, len(plan.chunks[-1].group))
    # The landing is a receive-only step, then the last prompt token runs as a decode row.
    first_decode = group.decode_cost.step_time(_decode_batch(8000))
    assert req.ttft == pytest.approx(landed + RECEIVE_STEP_S + first_decode, rel=1e-9)
    assert len(req.token_times) == 3 and result.rejected == []


def test_the_planner_takes_its_improvement_rate_from_the_table_by_simulated_arrivals() -> None:
    """The router's ImprovementRate runs in simulated time: a table whose only row says 1.0
    (never a larger SP than the smallest that fits) plans every request on one instance, like
    the constant 1.0, unlike the default 0.3 on an idle pool."""
    import dataclasses

    from gearshift.operator.planner.improvement_rate import RateStep

    trace = [
        TraceRequest(arrival_s=1.0 + 50 * i, prompt_tokens=8000, output_tokens=2) for i in range(3)
    ]
    base = _group()
    tabled = dataclasses.replace(base, rate_table=(RateStep(0.01, 1.0),))
    constant = dataclasses.replace(base, improvement_rate=1.0)
    ttft = {
        name: [r.ttft for r in simulate_tetris(g, trace).requests]
        for name, g in (("base", base), ("tabled", tabled), ("constant", constant))
    }
    assert ttft["tabled"] == pytest.approx(ttft["constant"], rel=1e-12)
    assert ttft["tabled"][0] > ttft["base"][0]  # one instance is slower than the SP 0.3 picks


def _decode_batch(context: int):
    from gearshift.worker.engine.scheduler import ScheduledBatch
    from gearshift.worker.engine.sequence import Sequence

    seq = Sequence("x", [0] * context, params=None, max_tokens=1)  # type: ignore[arg-type]
    seq.num_computed_tokens = context - 1
    batch = ScheduledBatch()
    batch.decodes.append(seq)
    return batch


def test_every_request_finishes_with_no_block_held_and_groups_split_the_trace() -> None:
    group = _group()
    trace = Traffic.from_mapping(
        {"rate": 3, "prompt": {"preset": "tetris-medium"}, "output": {"fixed": 32},
         "requests": 60}
    ).trace()  # fmt: skip
    one = simulate_tetris(group, trace)
    # A request no decode instance has room for waits (as in the router), none is refused.
    assert one.rejected == [] and len(one.requests) == 60
    assert all(len(r.token_times) == r.output_tokens for r in one.requests)
    two = simulate_groups(2, group, trace)
    assert two.rejected == [] and len(two.requests) == 60
    assert [r.request_id for r in two.requests] == sorted(
        (r.request_id for r in two.requests), key=lambda rid: int(rid[1:])
    )
    # Half the load per group: no request waits longer than on one group.
    assert max(r.ttft for r in two.requests) <= max(r.ttft for r in one.requests) + 1e-9


def test_a_decode_instance_out_of_kv_recomputes_what_it_preempts() -> None:
    """The engine's decode instance, simulated: placement checks a request's prompt and outputs
    against the blocks left, but does not reserve the growth of those already decoding, so a
    tight cache preempts. The instance recomputes what it preempted, over as many steps as
    its token budget takes (it did not, and those requests never ended: neither finished nor
    refused; then it stopped after the first chunk, 2026-11-28). Those placement finds no room
    for wait for it, and all 8 are served (5 were refused before the router's queue)."""
    cfg = ReplicaConfig(
        num_blocks=40, block_size=16, max_model_len=512, max_num_batched_tokens=64
    )  # a recompute of 100 prompt tokens and more takes several steps
    group = dataclasses.replace(_group(), config=cfg)
    trace = [TraceRequest(0.05 * i, prompt_tokens=100, output_tokens=200) for i in range(8)]
    result = simulate_tetris(group, trace)
    assert result.rejected == [] and len(result.requests) == 8
    assert all(len(r.token_times) == 200 for r in result.requests)
    assert sum(r.preemptions for r in result.requests) > 0


def test_requests_without_decode_room_wait_in_arrival_order_and_all_finish() -> None:
    """As the router's queue (operator/router/room_queue.py): a request no decode instance has
    room for waits until a step frees it, its TTFT counting the wait; a later one waits behind
    it even when it would fit; only one larger than an empty decode instance is refused (before:
    the third and the fifth were refused and the fourth served at once)."""
    cfg = ReplicaConfig(num_blocks=40, block_size=16, max_model_len=1024)  # 640 KV slots
    group = dataclasses.replace(_group(), config=cfg)
    trace = [
        TraceRequest(0.0, prompt_tokens=300, output_tokens=10),  # 19 blocks reserved
        TraceRequest(0.0, prompt_tokens=300, output_tokens=10),  # 19 more: 2 blocks left
        TraceRequest(0.001, prompt_tokens=300, output_tokens=10),  # waits
        TraceRequest(0.002, prompt_tokens=20, output_tokens=2),  # fits 2 blocks, yet waits
        TraceRequest(0.003, prompt_tokens=600, output_tokens=100),  # never fits 640
    ]
    result = simulate_tetris(group, trace)
    assert [i for i, _ in result.rejected] == [4]
    assert "700 KV slots" in result.rejected[0][1] and "640" in result.rejected[0][1]
    times = {r.request_id: r for r in result.requests}
    assert sorted(times) == ["r0", "r1", "r2", "r3"]
    assert all(len(r.token_times) == r.output_tokens for r in result.requests)
    room = min(times["r0"].finished, times["r1"].finished)  # the first room freed
    for i in (2, 3):  # neither got a first token before room was freed; TTFT counts the wait
        waited = times[f"r{i}"]
        assert waited.arrival == trace[i].arrival_s and waited.token_times[0] > room
        assert waited.ttft > room - trace[i].arrival_s


def test_a_request_waiting_past_the_routers_queue_timeout_is_refused() -> None:
    """The router answers 503 to a request still waiting for decode room after --queue-timeout;
    the simulator refuses it the same (a third request behind two that hold the cache)."""
    cfg = ReplicaConfig(num_blocks=40, block_size=16, max_model_len=1024)  # 640 KV slots
    trace = [
        TraceRequest(0.0, prompt_tokens=300, output_tokens=10),  # 19 blocks reserved
        TraceRequest(0.0, prompt_tokens=300, output_tokens=10),  # 19 more: 2 blocks left
        TraceRequest(0.001, prompt_tokens=300, output_tokens=10),  # waits for one to end
    ]
    waits = simulate_tetris(dataclasses.replace(_group(), config=cfg), trace)
    assert waits.rejected == [] and len(waits.requests) == 3
    third = next(r for r in waits.requests if r.request_id == "r2")
    bound = third.ttft / 2  # it waited longer than this
    short = dataclasses.replace(_group(), config=cfg, queue_timeout_s=bound)
    refused = simulate_tetris(short, trace)
    assert [i for i, _ in refused.rejected] == [2]
    assert f"within {bound:g} s" in refused.rejected[0][1]
    assert sorted(r.request_id for r in refused.requests) == ["r0", "r1"]


def test_more_requests_than_the_decode_instances_seats_are_all_served() -> None:
    """A request holds a block-table row from its placement on, not only while it has a seat:
    with 4 seats, a burst of 12 holds 12 rows (the engine's table had 4 and failed its decode
    instance, 2026-11-28); all 12 are served."""
    cfg = ReplicaConfig(num_blocks=2000, block_size=16, max_model_len=512, max_num_seqs=4)
    group = dataclasses.replace(_group(), config=cfg)
    trace = [TraceRequest(0.0, prompt_tokens=100, output_tokens=20) for _ in range(12)]
    result = simulate_tetris(group, trace)
    assert result.rejected == [] and len(result.requests) == 12
    assert all(len(r.token_times) == 20 for r in result.requests)


def test_a_higher_load_queues_the_pool() -> None:
    group = _group()

    def mean_ttft(rate: float) -> float:
        trace = Traffic.from_mapping(
            {"rate": rate, "prompt": {"preset": "tetris-long"}, "output": {"fixed": 8},
             "requests": 40}
        ).trace()  # fmt: skip
        done = simulate_tetris(group, trace).requests
        return sum(r.ttft for r in done) / len(done)

    assert mean_ttft(2.0) > 1.5 * mean_ttft(0.05)


def test_disaggregated_decode_keeps_tpot_below_colocated_tp_under_long_prompts() -> None:
    """Tetris §2.4: decode instances never share a step with a prefill, so the time per output
    token stays at decode speed where a colocated TP 8 group interleaves long prefills."""
    cands = {
        c.name: c
        for c in enumerate_candidates(
            _model(), hardware.preset("8xH200"), PlanSettings(max_model_len=131072)
        )
    }
    traffic = Traffic.from_mapping(
        {"rate": 1.5, "prompt": {"preset": "tetris-long"}, "output": {"fixed": 64},
         "requests": 60}
    )  # fmt: skip
    tetris = simulate_point(cands["tetris4p1x4"], traffic, 1.5, None)
    tp8 = simulate_point(cands["tp8"], traffic, 1.5, None)
    assert tetris["tpot_p99_s"] < tp8["tpot_p99_s"]


def test_plan_compares_tetris_with_the_other_policies() -> None:
    traffic = Traffic.from_mapping(
        {"rate": 2, "prompt": {"preset": "tetris-short"}, "output": {"fixed": 16},
         "requests": 30}
    )  # fmt: skip
    report = plan_deployment(
        _model(),
        hardware.preset("8xH200"),
        traffic,
        rates=[2.0],
        settings=PlanSettings(max_model_len=131072),
        kinds={"tetris", "static"},
        only=lambda c: c.name in ("tp8", "tetris4p1x4", "tetris6p1x2"),
    )
    data = report.to_json()
    assert {c["name"] for c in data["candidates"]} == {"tp8", "tetris4p1x4", "tetris6p1x2"}
    assert data["recommended"] in {"tp8", "tetris4p1x4", "tetris6p1x2"}
    tetris = next(c for c in data["candidates"] if c["name"] == "tetris4p1x4")
    assert tetris["policy"]["tetris"]["decodeTp"] == 4
    # The plan's improvement-rate table for the pool under this traffic (§5.1, §7.1), one row
    # per swept rate, in a policy the engine takes.
    table = tetris["policy"]["tetris"]["improvementRateTable"]
    assert [row["requestRate"] for row in table] == [2.0]
    assert 0.0 <= table[0]["improvementRate"] <= 1.0
    assert make_policy(tetris["policy"]).kind == "tetris"


def test_two_node_candidates_keep_decode_instances_whole_and_simulate() -> None:
    """On two nodes the candidates include groups whose pool spans both (the engine runs them):
    every decode instance inside one node (the operator accepts the policy for nodes: 2), and a
    point simulates with the planner seeing each instance's node."""
    from google.protobuf import json_format

    from gearshift.v1 import policy_pb2
    from gearshift.worker.policies.support import check_runnable

    settings = PlanSettings(max_model_len=131072)
    cands = enumerate_candidates(_model(), hardware.preset("16xH200"), settings, {"tetris"})
    spanning = {c.name: c for c in cands if c.notes.get("nodes") == 2}
    assert {"tetris15p1x1n2", "tetris8p2x4n2", "tetris12p1x4n2"} <= set(spanning)
    for c in spanning.values():
        assert c.gpus_per_group == 16
        proto = json_format.ParseDict(c.policy, policy_pb2.Policy())
        assert check_runnable(proto, nodes=2).kind == "tetris"
    traffic = Traffic.from_mapping(
        {"rate": 2, "prompt": {"preset": "tetris-medium"}, "output": {"fixed": 8}, "requests": 12}
    )
    point = simulate_point(spanning["tetris12p1x4n2"], traffic, 2.0, None)
    assert point["requests"] == 12 and point["rejected"] == 0, point
