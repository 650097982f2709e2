"""Build a model on its device and fill it from a weight source, shard by shard."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from gearshift.worker.errors import ModelLoadError
from gearshift.worker.model.config import ModelConfig
from gearshift.worker.model.llama import LlamaForCausalLM
from gearshift.worker.model.weights import WeightSource
from gearshift.worker.parallel.comm import CommGroup


def _route(model: LlamaForCausalLM, name: str) -> tuple[nn.Module, str, str | int | None]:
    """Checkpoint name → (owning module, parameter name, shard within a fused parameter)."""
    path, _, param = name.rpartition(".")
    parent, _, leaf = path.rpartition(".")
    if leaf in LlamaForCausalLM.STACKED:
        fused, shard = LlamaForCausalLM.STACKED[leaf]
        return model.get_submodule(f"{parent}.{fused}"), param, shard
    return model.get_submodule(path), param, None


def load_weights(
    model: LlamaForCausalLM, source: WeightSource, progress: Iterable[Any] | None = None
) -> None:
    """Copy every parameter's shard from ``source``; fail naming anything missing or unknown."""
    expected = _expected_keys(model)
    loaded: set[tuple[str, str, str | int | None]] = set()
    module_names = {id(mod): name for name, mod in model.named_modules()}
    names = source.names()
    iterator: Iterable[str] = progress if progress is not None else names
    for name in iterator:
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        try:
            module, param, shard = _route(model, name)
        except AttributeError as exc:
            raise ModelLoadError(f"checkpoint tensor {name!r} has no place in the model") from exc
        w = source.get(name)
        if shard is None:
            module.load_weight(param, w)  # type: ignore[operator]
        else:
            module.load_shard(param, shard, w)  # type: ignore[operator]
        loaded.add((module_names[id(module)], param, shard))
    missing = expected - loaded
    if missing:
        listed = ", ".join(
            sorted(f"{m}.{p}" + (f"[{s}]" if s is not None else "") for m, p, s in missing)[:8]
        )
        raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {listed}")


def _expected_keys(model: LlamaForCausalLM) -> set[tuple[str, str, str | int | None]]:
    keys: set[tuple[str, str, str | int | None]] = set()
    fused_shards: dict[str, list[str | int]] = {}
    for leaf, (fused, shard) in LlamaForCausalLM.STACKED.items():
        del leaf
        fused_shards.setdefault(fused, []).append(shard)
    for mod_name, module in model.named_modules():
        if mod_name == "lm_head" and model.config.tie_word_embeddings:
            continue
        for pname, _ in module.named_parameters(recurse=False):
            leaf = mod_name.rpartition(".")[2]
            if leaf in fused_shards:
                keys.update((mod_name, pname, s) for s in fused_shards[leaf])
            else:
                keys.add((mod_name, pname, None))
    return keys


def build_model(
    cfg: ModelConfig,
    source: WeightSource,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    tp: CommGroup | None = None,
    show_progress: bool = False,
    packing: str = "auto",
) -> LlamaForCausalLM:
    """Allocate the model (uninitialised) and load its shard of the weights; ``packing`` is
    cpu_features.choose_packing's choice (``auto``: make it here)."""
    with torch.device(device):
        model = LlamaForCausalLM(cfg, max_positions, tp or CommGroup.single(), dtype, device)
    progress = None
    if show_progress:
        from tqdm import tqdm

        progress = tqdm(source.names(), desc="Loading weights", unit="tensor", leave=False)
    with torch.no_grad():
        load_weights(model, source, progress)
        model.pack_weights(packing)
    model.eval()
    return model
