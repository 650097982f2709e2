"""A model's shape for the roofline cost model (issue 16, item 1b), read from a HF ``config.json``
without torch: layers, hidden, heads, KV heads, FFN size, vocab and the weights' dtype.

Only the dense decoder shape (Llama/Qwen/SmolLM style: attention with GQA, gated MLP) is modelled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "fp8": 1}
# The compute dtype whose FLOP/s apply (hardware.Device.flops keys).
DTYPE_FLOPS_KEY = {"float32": "bf16", "float16": "fp16", "bfloat16": "bf16"}
DTYPE_FLOPS_KEY.update({"float8_e4m3fn": "fp8", "fp8": "fp8"})


class ModelDescError(ValueError):
    """A model config is missing or invalid; the message names the field."""


@dataclass(frozen=True)
class ModelDesc:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    dtype: str = "bfloat16"
    # config.json's ``head_dim`` where it is not hidden / heads (Qwen3, Gemma); 0: hidden / heads.
    explicit_head_dim: int = 0

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        """The attention's width: every head's queries (and its output projection's input)."""
        return self.heads * self.head_dim

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def flops_key(self) -> str:
        return DTYPE_FLOPS_KEY[self.dtype]

    def layer_params(self) -> int:
        """q, o (hidden·q_dim) + k, v (hidden·kv_dim) + gate, up, down (3·hidden·ffn); norms
        ignored. q_dim is hidden unless config.json sets a head_dim of its own."""
        kv_dim = self.kv_heads * self.head_dim
        return 2 * self.hidden * (self.q_dim + kv_dim) + 3 * self.hidden * self.ffn

    def params(self) -> int:
        """All layers plus the LM head (the embedding lookup reads one row per token)."""
        return self.layers * self.layer_params() + self.vocab * self.hidden

    def weight_bytes(self) -> int:
        return self.params() * self.dtype_bytes

    def stage_shares(self, stages: int) -> StageShares:
        """Where a step's matmul work lies over a pipeline's stages, for the engine's layer
        split (``layout.stage_layers``): every token runs its layers on each stage, and each
        sampled row also runs the LM head on the last stage (which is most of the work of a
        small model with a large vocabulary, but only for the rows that sample: one per
        decode, one per prompt whose chunk ends it). Attention over the context is left out."""
        from gearshift.worker.parallel.layout import stage_layers

        per_token = [
            float(len(stage_layers(self.layers, stages, s)) * self.layer_params())
            for s in range(stages)
        ]
        per_row = [0.0] * stages
        per_row[-1] = float(self.vocab * self.hidden)
        return StageShares(tuple(per_token), tuple(per_row))

    def kv_bytes_per_token(self) -> int:
        """K and V of one token across all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class StageShares:
    """Each pipeline stage's share of a step, from its work: ``per_token`` for every token of
    the step (its layers) and ``per_row`` for every sampled row (the LM head)."""

    per_token: tuple[float, ...]
    per_row: tuple[float, ...]

    def __len__(self) -> int:
        return len(self.per_token)

    def valid(self) -> bool:
        return len(self.per_row) == len(self.per_token) and min(self.per_token + self.per_row) >= 0

    def for_batch(self, tokens: int, rows: int) -> tuple[float, ...]:
        """The shares of a step of ``tokens`` tokens of which ``rows`` sample."""
        work = [tokens * t + rows * r for t, r in zip(self.per_token, self.per_row, strict=True)]
        total = sum(work)
        if total <= 0:
            return (1.0 / len(work),) * len(work)
        return tuple(w / total for w in work)


def _int(cfg: dict[str, Any], keys: tuple[str, ...], where: str) -> int:
    for key in keys:
        value = cfg.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModelDescError(f"{where}: {key} must be a positive integer, got {value!r}")
            return value
    raise ModelDescError(f"{where}: missing {keys[0]}")


def from_config(cfg: Any, where: str = "config.json") -> ModelDesc:
    if not isinstance(cfg, dict):
        raise ModelDescError(f"{where}: expected a JSON object")
    heads = _int(cfg, ("num_attention_heads",), where)
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    if dtype not in DTYPE_BYTES:
        raise ModelDescError(f"{where}: torch_dtype {dtype!r} not one of {sorted(DTYPE_BYTES)}")
    desc = ModelDesc(
        name=str(cfg.get("_name_or_path") or Path(where).parent.name or "model"),
        layers=_int(cfg, ("num_hidden_layers", "n_layer"), where),
        hidden=_int(cfg, ("hidden_size", "n_embd"), where),
        heads=heads,
        kv_heads=int(cfg.get("num_key_value_heads") or heads),
        ffn=_int(cfg, ("intermediate_size",), where),
        vocab=_int(cfg, ("vocab_size",), where),
        dtype=dtype,
        explicit_head_dim=_int(cfg, ("head_dim",), where) if cfg.get("head_dim") else 0,
    )
    if desc.heads % desc.kv_heads:
        raise ModelDescError(
            f"{where}: kv heads (num_key_value_heads) must divide num_attention_heads"
        )
    if not desc.explicit_head_dim and desc.hidden % desc.heads:
        raise ModelDescError(
            f"{where}: num_attention_heads must divide hidden_size (or set head_dim)"
        )
    return desc


def load(path: str | Path) -> ModelDesc:
    """A config.json, or a directory holding one."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelDescError(f"--model {path}: cannot read a config.json: {exc}") from None
    return from_config(cfg, str(p))
