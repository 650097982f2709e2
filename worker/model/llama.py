"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM) over a packed token batch.

Tokens of all sequences in a step are packed into one [T, hidden] tensor; attention finds each
sequence's context through ``AttentionMetadata`` and the paged KV cache. The attention core is
injected (``AttentionCore``) so parallel layouts can wrap it without forking the model.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch
from torch import nn

from gearshift.worker.attention.metadata import AttentionMetadata
from gearshift.worker.kv.cache import LayerKV
from gearshift.worker.model.config import ModelConfig
from gearshift.worker.model.layers.activation import silu_and_mul
from gearshift.worker.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from gearshift.worker.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from gearshift.worker.model.layers.norm import RMSNorm
from gearshift.worker.model.layers.rotary import RotaryEmbedding, rotate
from gearshift.worker.parallel.comm import CommGroup


class AttentionCore(Protocol):
    """Attention after the QKV projection: q [T, Hq, D], k/v [T, Hkv, D] → [T, Hq, D]."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
    ) -> torch.Tensor: ...


Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin for this step's positions


class LlamaAttention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        tp: CommGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.qkv_bias,
            tp,
            dtype,
            device,
        )
        self.o_proj = RowParallelLinear(cfg.q_size, cfg.hidden_size, cfg.o_bias, tp, dtype, device)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_norm = (
            RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        )
        self.k_norm = (
            RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        )

    def forward(
        self,
        rope: Rope,
        hidden: torch.Tensor,
        kv: LayerKV,
        meta: AttentionMetadata,
        core: AttentionCore,
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        heads = self.num_heads + self.num_kv_heads
        # q and k sit side by side in the fused output: rotate them in one pass.
        qk = qkv[:, : q_size + kv_size].view(tokens, heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat(
                (self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])), dim=1
            )
        qk = rotate(qk, *rope)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, q_size + kv_size :].reshape(tokens, self.num_kv_heads, self.head_dim)
        out = core.forward(q, k, v, kv, meta)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(
        self, cfg: ModelConfig, tp: CommGroup, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [inter, inter], cfg.mlp_bias, tp, dtype, device
        )
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, cfg.mlp_bias, tp, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, tp: CommGroup, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, tp, dtype, device)
        self.mlp = LlamaMLP(cfg, tp, dtype, device)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

    def forward(
        self,
        rope: Rope,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv: LayerKV,
        meta: AttentionMetadata,
        core: AttentionCore,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual stream): the caller adds them in the next norm (vLLM-style),
        so every residual add is fused into an RMSNorm pass. Same rounding as Hugging Face's
        ``hidden = residual + out`` followed by a norm."""
        if residual is None:
            residual = hidden
            normed = self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm.add_forward(hidden, residual)
        attn = self.self_attn(rope, normed, kv, meta, core)
        normed, residual = self.post_attention_layernorm.add_forward(attn, residual)
        return self.mlp(normed), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        tp: CommGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden_size, tp, dtype, device
        )
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope, dtype, device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, tp, dtype, device) for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


class LlamaForCausalLM(nn.Module):
    """The whole decoder plus LM head, sharded over ``tp`` (one rank: ``CommGroup.single()``)."""

    # Checkpoint matrices that live inside one fused parameter: name → (fused module, shard).
    STACKED: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        tp: CommGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.model = LlamaModel(cfg, max_positions, tp, dtype, device)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype, device)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def num_kv_heads(self) -> int:
        """KV heads held by this rank (after splitting or replicating over TP)."""
        first = self.model.layers[0]
        assert isinstance(first, LlamaDecoderLayer)
        return first.self_attn.num_kv_heads

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerKV],
        meta: AttentionMetadata,
        core: AttentionCore,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm."""
        hidden = self.model.embed_tokens(input_ids)
        rope = self.model.rotary.table(positions)
        residual: torch.Tensor | None = None
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            hidden, residual = layer(rope, hidden, residual, kv, meta, core)
        if residual is None:  # a model without layers
            return self.model.norm(hidden)
        return self.model.norm.add_forward(hidden, residual)[0]

    def pack_weights(self) -> None:
        """Pre-pack every matmul weight for CPU inference where oneDNN supports the dtype."""
        for module in self.modules():
            pack = getattr(module, "pack_weights", None)
            if module is not self and callable(pack):
                pack()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocab logits on the TP group's first rank; None elsewhere."""
        return self.lm_head.logits(hidden)
