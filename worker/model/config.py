"""Model architecture description, read from a Hugging Face ``config.json`` or GGUF metadata."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gearshift.worker.errors import ModelLoadError, UnsupportedModelError

# Llama-family architectures that share one decoder implementation; the flags below cover their
# differences (QKV bias for Qwen2, q/k RMSNorm for Qwen3).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; ``kind`` is Hugging Face's ``rope_type``."""

    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Everything the decoder needs to build itself; independent of where weights come from."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {self.model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a parsed Hugging Face ``config.json`` (transformers 4.x or 5.x keys)."""
        model_type = str(cfg.get("model_type", ""))
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {cfg.get('hidden_act')!r} is not supported")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        sliding = cfg.get("sliding_window")
        if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
            sliding = None
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            rope=_rope_from_hf(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama exposes them through attention_bias.
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias") or False),
            o_bias=model_type == "llama" and bool(cfg.get("attention_bias") or False),
            mlp_bias=bool(cfg.get("mlp_bias") or False),
            qk_norm=model_type == "qwen3",
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> ModelConfig:
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"no config.json in model folder {folder}")
        return cls.from_hf_dict(json.loads(path.read_text()))

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
        """Build from GGUF key/values (already decoded to Python values)."""
        arch = str(fields.get("general.architecture", ""))
        if arch not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported")

        def get(key: str, default: Any = None) -> Any:
            return fields.get(f"{arch}.{key}", default)

        heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        kv_heads = int(get("attention.head_count_kv", heads))
        head_dim = int(get("attention.key_length", hidden // heads))
        vocab = get("vocab_size")
        if vocab is None:
            vocab = len(fields.get("tokenizer.ggml.tokens", []))
        scaling = str(get("rope.scaling.type", "none"))
        rope = RopeConfig(theta=float(get("rope.freq_base", 10000.0)))
        if scaling == "linear":
            rope = RopeConfig(
                theta=rope.theta, kind="linear", factor=float(get("rope.scaling.factor"))
            )
        elif scaling not in ("none", ""):
            raise UnsupportedModelError(f"GGUF rope scaling {scaling!r} is not supported")
        eos = fields.get("tokenizer.ggml.eos_token_id")
        return cls(
            model_type=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            max_position_embeddings=int(get("context_length", 4096)),
            rope=rope,
            tie_word_embeddings="output.weight" not in tensor_names,
            qkv_bias="blk.0.attn_q.bias" in tensor_names,
            o_bias="blk.0.attn_output.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            sliding_window=None,
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=(int(eos),) if eos is not None else (),
        )


def _rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    # transformers 5 folds theta and scaling into ``rope_parameters``; 4.x uses rope_theta and
    # rope_scaling. Accept both so checkpoints from either writer load.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", cfg.get("rope_theta") or 10000.0))
    kind = str(params.get("rope_type", params.get("type", "default")))
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "linear":
        return RopeConfig(theta=theta, kind="linear", factor=float(params["factor"]))
    if kind == "llama3":
        return RopeConfig(
            theta=theta,
            kind="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position=int(params["original_max_position_embeddings"]),
        )
    raise UnsupportedModelError(f"rope_type {kind!r} is not supported (default, linear, llama3)")
