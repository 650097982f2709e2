"""From ``--model`` to a loaded model: path, architecture, dtype, context length, KV size."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from gearshift.worker.comm import CommGroup
from gearshift.worker.config import DEFAULT_CPU_KV_BYTES, EngineConfig, resolve_dtype
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.kernels.cpu_features import choose_packing
from gearshift.worker.kv.cache import KVCacheSpec
from gearshift.worker.model.config import ModelConfig
from gearshift.worker.model.llama import LlamaForCausalLM, MlpFactory
from gearshift.worker.model.loader import build_model
from gearshift.worker.model.registry import resolve_model_path
from gearshift.worker.model.weights import GGUFSource, WeightSource, open_weight_source

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSpec:
    """What a checkpoint is, before any weight is read."""

    path: Path
    config: ModelConfig
    dtype: torch.dtype
    max_model_len: int
    packing: str = "plain"  # CPU matmul weights: "onednn" (pre-packed) or "plain"


def inspect_model(config: EngineConfig, device: torch.device) -> tuple[ModelSpec, WeightSource]:
    """Resolve the model, read its architecture, and settle dtype and context length."""
    path = resolve_model_path(config.model)
    source = open_weight_source(path)
    checkpoint_dtype: str | None = None
    if isinstance(source, GGUFSource):
        model_config = ModelConfig.from_gguf_fields(source.fields, source.tensor_names())
    else:
        raw = (
            json.loads((path / "config.json").read_text())
            if (path / "config.json").is_file()
            else None
        )
        if raw is None:
            model_config = ModelConfig.from_hf_folder(path)  # raises naming the missing file
        else:
            model_config = ModelConfig.from_hf_dict(raw)
            checkpoint_dtype = raw.get("torch_dtype") or raw.get("dtype")
    limit = model_config.max_position_embeddings
    if model_config.sliding_window:
        # No sliding-window attention kernel yet: keep contexts inside the window, exact.
        limit = min(limit, model_config.sliding_window)
    max_len = config.max_model_len or limit
    if max_len > limit:
        raise InvalidRequestError(
            "max_model_len", f"max_model_len {max_len} exceeds the model's context length {limit}"
        )
    dtype = resolve_dtype(config.dtype, checkpoint_dtype, device)
    try:
        packing = choose_packing(dtype, device, config.weight_packing)
    except ValueError as e:
        source.close()
        raise InvalidRequestError("weight_packing", str(e)) from e
    return ModelSpec(path, model_config, dtype, max_len, packing), source


def load_model(
    spec: ModelSpec,
    source: WeightSource,
    device: torch.device,
    tp: CommGroup | None = None,
    show_progress: bool = False,
    layers: range | None = None,
    mlp_factory: MlpFactory | None = None,
) -> LlamaForCausalLM:
    """This rank's shard of the model: ``tp``'s slice of ``layers`` (a pipeline stage), with a
    policy's FFN modules when it gives ``mlp_factory``."""
    try:
        return build_model(
            spec.config,
            source,
            spec.max_model_len,
            spec.dtype,
            device,
            tp,
            show_progress,
            packing=spec.packing,
            layers=layers,
            mlp_factory=mlp_factory,
        )
    finally:
        source.close()


def kv_cache_blocks(
    config: EngineConfig,
    kv: KVCacheSpec,
    device: torch.device,
    max_model_len: int,
    extra_bytes: int = 0,
    reserve_bytes: int = 0,
) -> int:
    """Number of KV blocks this rank allocates (identical on every rank of a group);
    ``extra_bytes``: weight memory a policy freed on this rank, added to the KV budget;
    ``reserve_bytes``: memory still to be taken (CUDA graphs' pool), kept out of a default
    budget (an explicit ``kv_cache_bytes`` is the cache's alone)."""
    if device.type == "cuda" and config.kv_cache_bytes is None:
        blocks = kv.blocks_for_device_fraction(config.gpu_memory_utilization, device, reserve_bytes)
    else:
        wanted = -(-config.max_num_seqs * max_model_len // kv.block_size)
        nbytes = (config.kv_cache_bytes or DEFAULT_CPU_KV_BYTES) + extra_bytes
        if config.kv_cache_bytes is None:
            nbytes -= reserve_bytes
        blocks = kv.blocks_for_bytes(nbytes)
        if config.kv_cache_bytes is None:
            blocks = min(blocks, wanted)  # the default never allocates more than can be used
    needed = -(-max_model_len // kv.block_size)
    if blocks < needed:
        raise InvalidRequestError(
            "kv_cache_bytes",
            f"the KV cache holds {blocks * kv.block_size} tokens, less than max_model_len "
            f"({max_model_len}); give it more memory or lower max_model_len",
        )
    return blocks
