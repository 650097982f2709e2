"""Build a model on its device and fill it from a weight source, shard by shard."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from gearshift.worker.comm import CommGroup
from gearshift.worker.errors import ModelLoadError
from gearshift.worker.model.config import ModelConfig
from gearshift.worker.model.llama import LlamaForCausalLM, MlpFactory
from gearshift.worker.model.weights import WeightSource

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _local_name(model: LlamaForCausalLM, name: str) -> str | None:
    """The module path of checkpoint tensor ``name`` on this rank, or None when it belongs to
    another pipeline stage (layers elsewhere, the embedding, final norm or LM head)."""
    held = model.model.layer_range
    m = _LAYER.match(name)
    if m:
        index = int(m.group(1))
        if index not in held:
            return None
        return f"model.layers.{index - held.start}.{name[m.end() :]}"
    tied = model.config.tie_word_embeddings
    if name == "model.embed_tokens.weight":
        if model.model.embed_tokens is not None:
            return name
        # A last stage without the embedding loads its tied LM head from the embedding matrix.
        return "lm_head.weight" if tied and model.lm_head is not None else None
    if name == "lm_head.weight":
        return None if tied or model.lm_head is None else name
    if name.startswith("model.norm.") and model.model.norm is None:
        return None
    return name


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
        local = _local_name(model, name)
        if local is None:
            continue
        try:
            module, param, shard = _route(model, local)
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
        if (
            mod_name == "lm_head"
            and model.config.tie_word_embeddings
            and model.model.embed_tokens is not None
        ):
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
    layers: range | None = None,
    mlp_factory: MlpFactory | None = None,
) -> LlamaForCausalLM:
    """Allocate the model (uninitialised) and load its shard of the weights; ``packing`` is
    cpu_features.choose_packing's choice (``auto``: make it here). A policy's ``mlp_factory``
    FFN modules load the checkpoint tensors they declare parameters for; the policy hides the
    others from ``source``."""
    with torch.device(device):
        model = LlamaForCausalLM(
            cfg, max_positions, tp or CommGroup.single(), dtype, device, layers, mlp_factory
        )
    progress = None
    if show_progress:
        from tqdm import tqdm

        progress = tqdm(source.names(), desc="Loading weights", unit="tensor", leave=False)
    with torch.no_grad():
        load_weights(model, source, progress)
        model.pack_weights(packing)
    model.eval()
    return model
