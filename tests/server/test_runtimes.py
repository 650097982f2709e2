"""The table of group runtimes (worker/server/runtimes.py): each policy's group is started and
served by the runtime the policy names, a name the table does not have is refused naming the
policy, and the one-engine launcher refuses a group of another shape before starting anything."""

from __future__ import annotations

import pytest

from gearshift.worker.config import EngineConfig
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.launch import start_engine
from gearshift.worker.policies.registry import make_policy
from gearshift.worker.policies.static.policy import StaticPolicy
from gearshift.worker.server.engine_process import ProcessEngine
from gearshift.worker.server.replica_engine import ReplicaGroupEngine
from gearshift.worker.server.runtimes import RUNTIMES, Runtime, runtime_for
from gearshift.worker.server.tetris_engine import TetrisGroupEngine

TETRIS = {"tetris": {"prefill_instances": 2, "decode_instances": 1}}


@pytest.mark.parametrize(
    ("policy", "world", "endpoint"),
    [
        ({"static": {"tp": 2}}, 2, ProcessEngine),
        ({"shift": {"sp": 2}}, 2, ProcessEngine),
        ({"sidp": {"dp": 2}}, 2, ReplicaGroupEngine),
        (TETRIS, 3, TetrisGroupEngine),
    ],
    ids=["static", "shift", "sidp", "tetris"],
)
def test_each_policy_is_served_by_the_runtime_it_names(
    policy: dict[str, object], world: int, endpoint: type
) -> None:
    runtime = runtime_for(make_policy(policy, world))
    assert isinstance(runtime, Runtime) and runtime.make_endpoint is endpoint


class _Elsewhere(StaticPolicy):
    """A policy whose group needs a runtime this worker lacks."""

    def group_runtime(self) -> str:
        return "quantum"


def test_a_runtime_the_table_lacks_is_refused_naming_the_policy() -> None:
    policy = _Elsewhere(make_policy({"static": {}}).to_proto(), 1)
    with pytest.raises(InvalidRequestError) as info:
        runtime_for(policy)
    assert info.value.field == "policy.static" and "'quantum'" in info.value.message
    assert sorted(RUNTIMES) == ["engine", "replicas", "tetris"]


def test_the_one_engine_launcher_refuses_a_tetris_group() -> None:
    config = EngineConfig(model="/nonexistent", dtype="float32")
    with pytest.raises(InvalidRequestError, match="'tetris' group") as info:
        start_engine(config, make_policy(TETRIS, 3))
    assert info.value.field == "policy.tetris"
