"""Multi-rank fixtures: groups whose leader runs in the test process, followers spawned."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gearshift.worker.config import EngineConfig
from gearshift.worker.engine.llm_engine import LLMEngine
from gearshift.worker.launch import ParallelConfig, start_engine
from tests.worker.helpers import RecordingExecutor


@pytest.fixture
def group_factory() -> Iterator[Callable[..., LLMEngine]]:
    """Start worker groups; each is shut down (every rank joined) and checked for leaks."""
    engines: list[LLMEngine] = []

    def start(model: Any, parallel: ParallelConfig, record: bool = True, **kw: Any) -> LLMEngine:
        kw.setdefault("dtype", "float32")
        kw.setdefault("kv_cache_bytes", 32 << 20)
        # Short timeouts: a broken test fails in seconds, not minutes.
        engine = start_engine(EngineConfig(model=str(model), **kw), parallel)
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
