"""A complete engine in this process (one rank); multi-rank groups start in worker/launch.py."""

from __future__ import annotations

from gearshift.worker.config import EngineConfig
from gearshift.worker.engine.llm_engine import LLMEngine


def build_local_engine(config: EngineConfig) -> LLMEngine:
    """Model, tokenizer, KV cache, scheduler and sampler, all in this process."""
    from gearshift.worker.launch import ParallelConfig, start_engine

    return start_engine(config, ParallelConfig())
