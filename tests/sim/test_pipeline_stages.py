"""A pipeline's stages in simulated time: each stage holds a micro-batch for its share of the
step (``ModelDesc.stage_shares``: the engine's layer split, the LM head on the last stage), so
the slowest stage sets the pace."""

from __future__ import annotations

import functools

import pytest

from gearshift.operator.sim import model_desc
from gearshift.operator.sim.cost_model import LinearFit, StepCostModel
from gearshift.operator.sim.replica import ReplicaConfig
from gearshift.operator.sim.simulator import Deployment, simulate
from gearshift.operator.sim.trace import TraceRequest
from gearshift.worker.engine.contract import pipeline_share

UNIT = StepCostModel(LinearFit(1.0, 0.0, 0.0), LinearFit(1.0, 0.0, 0.0))  # one second a step
CONFIG = ReplicaConfig(num_blocks=512, block_size=16, max_num_seqs=16, max_num_batched_tokens=512,
                       max_model_len=1024)  # fmt: skip


def _makespan(shares: tuple[float, ...]) -> float:
    trace = [TraceRequest(0.0, 8, 40) for _ in range(8)]
    deployment = Deployment(
        1,
        CONFIG,
        UNIT,
        functools.partial(pipeline_share, stages=2),
        micro_batches=2,
        stages=2,
        stage_shares=shares,
    )
    return simulate(deployment, trace).makespan


def test_the_slowest_stage_sets_the_pipelines_pace() -> None:
    equal = _makespan(())
    assert _makespan((0.5, 0.5)) == pytest.approx(equal)
    # Two micro-batches of 40 decode steps each: a micro-batch every 0.5 s with equal stages,
    # every 0.8 s when the last stage holds 80% of the trip.
    lopsided = _makespan((0.2, 0.8))
    assert lopsided == pytest.approx(equal * 0.8 / 0.5, rel=0.05)
    # One stage doing everything is no pipeline at all.
    assert _makespan((0.0, 1.0)) == pytest.approx(equal * 2, rel=0.05)
    with pytest.raises(ValueError, match="stage_shares"):
        _makespan((1.0,))


def test_stage_shares_follow_the_engines_layer_split_and_the_lm_head() -> None:
    small = model_desc.ModelDesc("small", 5, 256, 8, 2, 1024, 49152, "float32")
    shares = small.stage_shares(2)
    assert sum(shares) == pytest.approx(1.0)
    # Stage 0 runs layers 0-2 (the engine gives earlier stages the remainder), stage 1 runs
    # layers 3-4 and the LM head (49152 x 256), the bulk of this model.
    layer = small.layer_params()
    assert shares[0] == pytest.approx(3 * layer / small.params())
    assert shares[1] > 0.75
    big = model_desc.ModelDesc("big", 32, 4096, 32, 8, 14336, 128256)
    assert 0.5 < big.stage_shares(2)[1] < 0.56  # the LM head is ~2.4 layers of a 32-layer model
