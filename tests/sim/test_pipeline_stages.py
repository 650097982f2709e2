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
from gearshift.worker.engine.scheduler import ScheduledBatch

UNIT = StepCostModel(LinearFit(1.0, 0.0, 0.0), LinearFit(1.0, 0.0, 0.0))  # one second a step
CONFIG = ReplicaConfig(num_blocks=512, block_size=16, max_num_seqs=16, max_num_batched_tokens=512,
                       max_model_len=1024)  # fmt: skip


def _makespan(
    shares: tuple[float, ...] | model_desc.StageShares, trace: list[TraceRequest] | None = None
) -> float:
    trace = trace or [TraceRequest(0.0, 8, 40) for _ in range(8)]
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
    decode = small.stage_shares(2).for_batch(8, 8)  # every row samples
    assert sum(decode) == pytest.approx(1.0)
    # Stage 0 runs layers 0-2 (the engine gives earlier stages the remainder), stage 1 runs
    # layers 3-4 and the LM head (49152 x 256), the bulk of this model's work per sampled row.
    layer = small.layer_params()
    assert decode[0] == pytest.approx(3 * layer / small.params())
    assert decode[1] > 0.75
    # A 128-token prompt chunk samples one row: the LM head hardly counts, the layers do.
    prefill = small.stage_shares(2).for_batch(128, 1)
    assert prefill[0] == pytest.approx(3 * layer / (5 * layer + small.vocab * 256 / 128))
    assert 0.4 < prefill[1] < 0.5
    big = model_desc.ModelDesc("big", 32, 4096, 32, 8, 14336, 128256)
    # The LM head is ~2.4 layers of a 32-layer model.
    assert 0.5 < big.stage_shares(2).for_batch(1, 1)[1] < 0.56


def test_a_pipelines_prefill_chunks_use_the_layer_split_and_its_decodes_the_lm_head() -> None:
    """The replica prices each step by its own tokens and sampled rows: with the LM head the
    bulk of a decode, a prefill-only trace pipelines like equal stages and a decode-heavy one
    runs at the last stage's pace."""
    shares = model_desc.StageShares((1.0, 1.0), (0.0, 8.0))
    assert shares.for_batch(64, 1) == pytest.approx((64 / 136, 72 / 136))
    assert shares.for_batch(4, 4) == pytest.approx((0.1, 0.9))

    decodes = [TraceRequest(0.0, 8, 40) for _ in range(8)]
    assert _makespan(shares, decodes) == pytest.approx(_makespan((0.1, 0.9), decodes), rel=0.05)
    prompts = [TraceRequest(0.0, 400, 1) for _ in range(8)]
    assert _makespan(shares, prompts) < _makespan((0.1, 0.9), prompts) * 0.7
    with pytest.raises(ValueError, match="stage_shares"):
        _makespan(model_desc.StageShares((1.0, 1.0), (0.0, -1.0)), decodes)


class _Steps:
    """A policy's hooks (replica.SimHooks) for a 2-stage pipeline of 1-second trips, every
    step behind a barrier of every rank or none."""

    def __init__(self, barrier: bool) -> None:
        self._barrier = barrier

    def bind(self, scheduler: object, blocks: object) -> None:
        return None

    def step_request(self, queues: object) -> object:
        return pipeline_share(queues, stages=2)  # type: ignore[arg-type]

    def held(self) -> frozenset[str]:
        return frozenset()

    def step_submitted(self) -> None:
        return None

    def micro_batches(self) -> int:
        return 2

    def step_time(self, batch: ScheduledBatch) -> tuple[float, int]:
        return (0.0 if batch.is_empty else 1.0), 2

    def barrier(self) -> bool:
        return self._barrier


def test_a_step_behind_a_barrier_of_every_rank_waits_for_the_pipeline_to_drain() -> None:
    """Seesaw's synchronous swap-out makes every rank meet before the step: the micro-batch
    ahead must have left the last stage before this one enters the first, so two micro-batches
    no longer overlap."""
    trace = [TraceRequest(0.0, 8, 40) for _ in range(8)]

    def makespan(barrier: bool) -> float:
        deployment = Deployment(1, CONFIG, UNIT, hooks=lambda: _Steps(barrier))  # type: ignore[arg-type,return-value]
        return simulate(deployment, trace).makespan

    # 2 micro-batches x 40 decode steps: a micro-batch every 0.5 s when they overlap, every 1 s
    # when each waits for the other to leave.
    assert makespan(True) == pytest.approx(2 * makespan(False), rel=0.05)
