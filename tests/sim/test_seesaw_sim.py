"""Seesaw in the simulator (issue 16; Seesaw §4): the engine's own leader drives each replica's
steps, prefill steps run on the PP gear and decode steps on the TP gear, switches re-shard, and
the leader never stalls with prompts waiting."""

from __future__ import annotations

import pytest

from gearshift.operator.sim import hardware, model_desc
from gearshift.operator.sim.candidates import PlanSettings, enumerate_candidates
from gearshift.operator.sim.planning import plan_deployment
from gearshift.operator.sim.reproduce.seesaw import MODELS, gpu
from gearshift.operator.sim.seesaw_sim import SeesawHooks
from gearshift.operator.sim.simulator import Deployment, simulate
from gearshift.operator.sim.traffic import Traffic
from gearshift.worker.policies import checks
from gearshift.worker.policies.registry import parse_policy
from gearshift.worker.policies.seesaw.leader import Phase


def _model() -> model_desc.ModelDesc:
    return model_desc.from_config({**MODELS["LLaMA2-13B"], "torch_dtype": "float16"}, "13B")


def _run(requests: int, max_num_seqs: int = 256) -> tuple[list[SeesawHooks], object]:
    settings = PlanSettings(max_model_len=8192, max_num_seqs=max_num_seqs)
    cands = enumerate_candidates(_model(), gpu("L4"), settings, {"seesaw"})
    c = next(c for c in cands if c.name == "seesaw8")
    assert c.hooks is not None
    made: list[SeesawHooks] = []

    def hooks() -> SeesawHooks:
        h = c.hooks()  # type: ignore[misc]
        made.append(h)  # type: ignore[arg-type]
        return h  # type: ignore[return-value]

    trace = Traffic.from_mapping(
        {"rate": 1000, "prompt": {"preset": "sharegpt"}, "requests": requests}
    ).trace()
    result = simulate(Deployment(c.replicas, c.config, c.cost, hooks=hooks), trace)
    return made, result


def test_the_leader_alternates_phases_and_every_request_finishes() -> None:
    made, result = _run(120, max_num_seqs=32)
    # Every request ran to its end, except prompts longer than the context (refused, as the
    # engine refuses them).
    done, refused = len(result.requests), len(result.rejected)  # type: ignore[attr-defined]
    assert done + refused == 120 and done > 100
    leader = made[0].leader
    phases = [t.to for t in leader.transitions]
    assert phases[:2] == [Phase.DECODE, Phase.PREFILL] and len(phases) >= 3
    # With 32 seats and 120 prompts, prefill phases end when every seat is held (the stall the
    # simulator found in the engine's leader), not only on host usage.
    assert any("seats taken" in t.reason for t in leader.transitions)
    assert leader.swap_out_bytes > 0 and leader.swap_in_bytes > 0


def test_a_step_is_priced_by_its_phase_gear_and_a_switch_reshards() -> None:
    model, hw = _model(), gpu("L4")
    h = SeesawHooks(model, hw, 8, 16)
    assert h.micro_batches() == 8  # prefill phase: PP 8 micro-batches in flight
    from gearshift.worker.engine.scheduler import ScheduledBatch

    empty = ScheduledBatch()
    assert h.step_time(empty) == (0.0, 8)
    h.leader._switched = True  # what a switch leaves for the step that carries it
    trip, stages = h.step_time(empty)
    assert trip == h._reshard_s > 0 and stages == 8
    h.leader.phase = Phase.DECODE
    assert h.micro_batches() == 1 and h.step_time(empty)[1] == 1


def test_seesaw_candidates_are_policies_the_engine_runs_and_beat_static_on_pcie() -> None:
    model, hw = _model(), gpu("L4")
    settings = PlanSettings(max_model_len=8192)
    for c in enumerate_candidates(model, hw, settings, {"seesaw"}):
        p = parse_policy(c.policy)
        assert checks.layout_errors(p, c.gpus_per_group) == []
    t = Traffic.from_mapping({"rate": 1000, "prompt": {"preset": "sharegpt"}, "requests": 200})
    report = plan_deployment(
        model, hw, t, rates=[1000], settings=settings,
        only=lambda c: c.name in ("tp8", "pp8", "seesaw8"),
    )  # fmt: skip
    tps = {r.candidate.name: r.at_rate["total_tokens_per_s"] for r in report.results}  # type: ignore[index]
    # PCIe: PP's prefill and TP's decode together beat either alone (Seesaw §6.2).
    assert tps["seesaw8"] > max(tps["tp8"], tps["pp8"])
    assert hardware.preset("8xL4").count == 8


def test_measured_prices_replace_the_roofline_and_writes_add_to_the_step_on_cpu() -> None:
    """``Measured`` (benchmarks/sim_fidelity_seesaw.py): each gear's profiled step, a block's
    copy each way, a re-shard and the host store's size, and KV writes before the step (CPU)
    or beside it (a copy engine)."""
    from dataclasses import replace

    from gearshift.operator.sim.seesaw_sim import Measured
    from gearshift.worker.engine.scheduler import ScheduledBatch

    class Flat:
        def __init__(self, s: float) -> None:
            self.s = s

        def step_time(self, batch: ScheduledBatch) -> float:
            return self.s

    prices = Measured(Flat(0.010), Flat(0.002), 0.001, 0.003, 0.05, host_pages=7)
    h = SeesawHooks(_model(), None, 2, 16, measured=prices)
    assert h.leader.pages.num_pages == 7
    busy = ScheduledBatch(decodes=[object()])  # type: ignore[list-item]
    assert h.step_time(busy) == (0.010, 2)  # the prefill gear's price
    assert not h.barrier()
    h.leader._out = [1, 2, 3, 4]  # two blocks to the host store
    h.leader._in = [5, 6]  # one from it
    h.leader._switched = True
    assert h.step_time(busy)[0] == pytest.approx(0.05 + 0.001 + 0.010 + 2 * 0.003)
    assert h.barrier()  # a synchronous swap-out: every rank meets first
    overlapped = SeesawHooks(_model(), None, 2, 16, measured=replace(prices, overlap_out=True))
    overlapped.leader._out = [1, 2, 3, 4]
    assert overlapped.step_time(busy)[0] == pytest.approx(max(0.010, 2 * 0.003))
    assert not overlapped.barrier()
    h.leader.phase = Phase.DECODE
    h.leader._out, h.leader._in, h.leader._switched = [], [], False
    assert h.step_time(busy) == (0.002, 1)  # the decode gear's price
