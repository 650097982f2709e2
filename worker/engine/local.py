"""Build a complete single-process engine from an EngineConfig."""

from __future__ import annotations

import logging
import time

import torch
from gearshift.worker.attention.torch_ref import TorchAttention
from gearshift.worker.config import EngineConfig
from gearshift.worker.engine.llm_engine import LLMEngine
from gearshift.worker.engine.loading import inspect_model, kv_cache_blocks, load_model
from gearshift.worker.engine.model_runner import ModelRunner
from gearshift.worker.kv.block_manager import BlockManager
from gearshift.worker.kv.cache import KVCacheSpec, allocate_kv_cache
from gearshift.worker.tokenizer.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def build_local_engine(config: EngineConfig) -> LLMEngine:
    """Model, tokenizer, KV cache, scheduler and sampler, all in this process."""
    started = time.monotonic()
    device = torch.device(config.device)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    spec, source = inspect_model(config, device)
    tokenizer = None if config.skip_tokenizer_init else Tokenizer.from_path(spec.path)
    model = load_model(spec, source, device, show_progress=config.show_progress)
    cfg = spec.config
    kv_spec = KVCacheSpec(
        cfg.num_layers, model.num_kv_heads, cfg.head_dim, config.block_size, spec.dtype
    )
    num_blocks = kv_cache_blocks(config, kv_spec, device, spec.max_model_len)
    kv = allocate_kv_cache(kv_spec, num_blocks, device)
    runner = ModelRunner(model, kv, TorchAttention(cfg.head_dim**-0.5), device)
    blocks = BlockManager(
        num_blocks,
        config.block_size,
        config.max_num_seqs,
        -(-spec.max_model_len // config.block_size),
        config.enable_prefix_caching,
    )
    eos = frozenset(cfg.eos_token_ids) | (tokenizer.eos_token_ids if tokenizer else frozenset())
    log.info(
        "engine ready in %.1fs: %s, %s, max_model_len=%d, %d KV blocks (%.0f MiB)",
        time.monotonic() - started,
        spec.path.name,
        str(spec.dtype).removeprefix("torch."),
        spec.max_model_len,
        num_blocks,
        num_blocks * kv_spec.bytes_per_block / 2**20,
    )
    return LLMEngine(config, runner, blocks, spec.max_model_len, cfg.vocab_size, eos, tokenizer)
