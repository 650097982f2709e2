"""Adding a policy is adding a package: a test-only policy runs with no edit outside itself.

``PhasedPolicy`` below stands for a new technique: it takes the ``seesaw`` slot of the proto for
the test's duration, builds its own gear on every rank, and uses the step contract's say in
scheduling (prefill-only steps while prompts wait, decode-only steps otherwise). It is
registered from the test; nothing in worker/ knows it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gearshift.v1 import policy_pb2
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.model.config import ModelConfig
from gearshift.worker.parallel.groups import create_groups
from gearshift.worker.parallel.layout import Layout
from gearshift.worker.policies import registry
from gearshift.worker.policies.base import (
    Policy,
    QueueView,
    RankContext,
    RankModel,
    StepKind,
    StepRequest,
)
from gearshift.worker.policies.gears import build_gear
from gearshift.worker.sampling.params import SamplingParams
from tests.worker.helpers import RecordingExecutor

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
ENGINE = {"skip_tokenizer_init": True, "block_size": 4}


class PhasedPolicy(Policy):
    """Prefill-only steps while prompts wait, then decode-only steps; TP over the decode gear's
    ranks (``seesaw.decode.tp``)."""

    kind = "seesaw"

    def __init__(self, policy: policy_pb2.Policy, world_size: int) -> None:
        super().__init__(policy, world_size)
        self.layout = Layout(tp=world_size)
        self.gear_names = ("phased",)
        self.kinds: list[StepKind] = []

    def check_model(self, cfg: ModelConfig) -> None:
        self.layout.check_model(cfg.num_heads, cfg.num_kv_heads, cfg.num_layers)

    def build_rank(self, ctx: RankContext) -> RankModel:
        cfg = ctx.spec.config
        groups = create_groups(self.layout, ctx.rank, cfg.num_kv_heads, ctx.timeout)
        gear = build_gear("phased", ctx, groups, groups.tp, ulysses=False)
        return RankModel([gear], cfg.num_layers, self.layout.kv_heads_per_rank(cfg.num_kv_heads))

    def step_request(self, queues: QueueView) -> StepRequest:
        kind = StepKind.PREFILL if queues.waiting else StepKind.DECODE
        self.kinds.append(kind)
        return StepRequest(kind=kind)


@pytest.fixture
def phased() -> Iterator[type[PhasedPolicy]]:
    previous = registry._POLICIES.get(PhasedPolicy.kind)  # the built-in one, restored after
    registry.register(PhasedPolicy)
    try:
        yield PhasedPolicy
    finally:
        registry.unregister(PhasedPolicy.kind)
        if previous is not None:
            registry._POLICIES[PhasedPolicy.kind] = previous  # its "module:Class" path


def test_unimplemented_policies_are_refused_by_name(monkeypatch):
    # Every kind is implemented today; a registry without one must refuse it by name.
    monkeypatch.delitem(registry._POLICIES, "tetris")
    with pytest.raises(InvalidRequestError) as info:
        registry.make_policy({"tetris": {}})
    assert info.value.field == "policy.tetris"
    assert "not implemented" in info.value.message
    with pytest.raises(InvalidRequestError, match="policy"):
        registry.make_policy('{"static": {"tp": "two"}}')
    assert registry.make_policy("static:\n  tp: 2\n").world_size == 2  # YAML too


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_policy_registered_from_a_test_runs_through_the_contract(
    ranks, phased, tiny_checkpoint, group_factory
):
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2)
    prompts = [[5, 6, 7, 8, 9], [1, 2, 3], [9, 8, 7, 6, 5, 4, 3]]
    reference = group_factory(folder, None, record=False, **ENGINE)
    want = [o.token_ids for o in reference.generate(prompts, GREEDY)]

    config = {"seesaw": {"prefill": {"tp": 1, "pp": ranks}, "decode": {"tp": ranks, "pp": 1}}}
    policy = registry.make_policy(config, ranks)
    assert isinstance(policy, PhasedPolicy)
    engine = group_factory(folder, policy, **ENGINE)
    got = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    assert got == want
    assert engine.policy.to_proto().WhichOneof("kind") == "seesaw"
    recorder = engine.executor
    assert isinstance(recorder, RecordingExecutor)
    plans = recorder.submitted
    # The policy's say was obeyed: no step mixed prefill chunks with decodes, and both ran.
    assert all(p.num_decodes == 0 or not p.prefill_query_lens for p in plans)
    assert any(p.num_decodes == 0 for p in plans) and any(p.num_decodes for p in plans)
    assert {StepKind.PREFILL, StepKind.DECODE} <= set(policy.kinds)
