"""Multi-rank fixtures: groups whose leader runs in the test process, followers spawned."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gearshift.worker.config import EngineConfig
from gearshift.worker.engine.llm_engine import LLMEngine
from gearshift.worker.launch import GroupConfig, start_engine
from tests.worker.helpers import RecordingExecutor


@pytest.fixture
def group_factory() -> Iterator[Callable[..., LLMEngine]]:
    """Start worker groups; each is shut down (every rank joined) and checked for leaks."""
    engines: list[LLMEngine] = []

    def start(
        model: Any,
        policy: Any,
        record: bool = True,
        group: GroupConfig | None = None,
        **kw: Any,
    ) -> LLMEngine:
        """``policy``: the CRD's spec.policy object (e.g. {"static": {"tp": 2}}) or a Policy."""
        kw.setdefault("dtype", "float32")
        kw.setdefault("kv_cache_bytes", 32 << 20)
        engine = start_engine(EngineConfig(model=str(model), **kw), policy, group)
        if record:
            engine.executor = RecordingExecutor(engine.executor)
        engines.append(engine)
        return engine

    yield start
    for engine in engines:
        inner = getattr(engine.executor, "inner", engine.executor)
        children = list(getattr(inner, "children", []))
        assert not engine.has_unfinished_requests()
        assert engine.blocks.leaked_blocks() == []
        engine.shutdown()
        assert all(not p.is_alive() for p in children), "a follower rank outlived its group"
