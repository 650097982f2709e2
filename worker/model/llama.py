"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM) over a packed token batch.

Tokens of all sequences in a step are packed into one [T, hidden] tensor; attention finds each
sequence's context through ``AttentionMetadata`` and the paged KV cache. The attention core is
injected (``AttentionCore``) so parallel layouts can wrap it without forking the model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from gearshift.worker import kernels
from gearshift.worker.attention.core import AttentionCore
from gearshift.worker.attention.cpu_backend import CpuAttention
from gearshift.worker.attention.metadata import AttentionMetadata
from gearshift.worker.comm import CommGroup
from gearshift.worker.kernels.cpu_features import choose_packing
from gearshift.worker.kv.cache import LayerKV
from gearshift.worker.model.config import ModelConfig
from gearshift.worker.model.layers import fused_triton
from gearshift.worker.model.layers.activation import silu_and_mul
from gearshift.worker.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from gearshift.worker.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from gearshift.worker.model.layers.norm import RMSNorm
from gearshift.worker.model.layers.rotary import RotaryEmbedding, rotate

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin for this step's positions
# A policy's FFN for a global layer index, used instead of the layer's own weights (e.g. FFN
# weights that live on another rank); the module maps [T, hidden] to [T, hidden].
MlpFactory = Callable[[int], nn.Module]
# A policy's way to run a step's decoder layers (e.g. SiDP's CaS micro-batches, which interleave
# the layers of two halves of the batch): (layers, rope, hidden, residual, kv caches, metadata,
# core) → (hidden, residual), or None when this step runs the plain layer loop.
LayerRunner = Callable[
    [
        Sequence["LlamaDecoderLayer"],
        Rope,
        torch.Tensor,
        torch.Tensor | None,
        Sequence[LayerKV],
        AttentionMetadata,
        AttentionCore,
    ],
    tuple[torch.Tensor, torch.Tensor] | None,
]
# The FFN tensors of one layer in the fused decode op's slot order: gate|up weight, its bias,
# down weight, its bias.
FfnTensors = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]


@runtime_checkable
class LendsFfn(Protocol):
    """A policy's FFN whose weights may sit elsewhere between steps (SiDP: a WaS cache slot),
    run inside the fused decode op when it lends them for one layer of one step."""

    def fusable(self) -> bool:
        """Whether this step's FFN can run from lent weights (not, e.g., in SiDP's CaS)."""
        ...

    def lend(self) -> FfnTensors:
        """This layer's weights for this step (waits until they are there)."""
        ...

    def give_back(self) -> None:
        """The layer ran: its lent weights may be reused."""
        ...


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
        self.fused_rope = False  # the Triton kernel on CUDA (model/fused_ops.py decides)

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
        if self.fused_rope and qk.stride(-1) == 1:
            qk = fused_triton.rotary(qk, *rope)
        else:
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
        self.fused_silu = False  # the Triton kernel on CUDA (model/fused_ops.py decides)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused_silu and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
            return self.down_proj(fused_triton.silu_and_mul(gate_up))
        return self.down_proj(silu_and_mul(gate_up))


@dataclass(frozen=True)
class FusedDecodeArgs:
    """What ``kernels.decode_layer`` needs of one layer besides the step's tensors, built once."""

    weights: list[torch.Tensor | None]  # the op's weight slots (packed oneDNN or plain weights)
    num_heads: int
    eps: float
    lender: LendsFfn | None = None  # fills the FFN slots per step (a policy's FFN)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        tp: CommGroup,
        dtype: torch.dtype,
        device: torch.device,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, tp, dtype, device)
        self.mlp = mlp if mlp is not None else LlamaMLP(cfg, tp, dtype, device)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.fused: FusedDecodeArgs | None = None  # set by prepare_fused_decode()

    def prepare_fused_decode(self, tp: CommGroup) -> None:
        """Cache this layer's arguments of ``kernels.decode_layer`` (after packing) if the op can
        run it: one rank (no collective inside the layer), no q/k norm, CPU weights of one dtype.
        """
        attn, mlp = self.self_attn, self.mlp
        self.fused = None
        lender = mlp if isinstance(mlp, LendsFfn) else None
        if not isinstance(mlp, LlamaMLP) and lender is None:
            return  # a policy's FFN that cannot lend its weights runs outside the fused op
        norms = (self.input_layernorm, self.post_attention_layernorm)
        linears: tuple[ReplicatedLinear, ...] = (attn.qkv_proj, attn.o_proj)
        if isinstance(mlp, LlamaMLP):
            linears += (mlp.gate_up_proj, mlp.down_proj)
        dtype = norms[0].weight.dtype
        tensors = [n.weight for n in norms] + [lin.weight for lin in linears]
        tensors += [lin.bias for lin in linears if lin.bias is not None]
        self.fused = None
        if (
            tp.size > 1
            or attn.q_norm is not None
            or norms[0].eps != norms[1].eps
            or dtype not in (torch.float32, torch.bfloat16, torch.float16)
            or any(t.dtype != dtype or t.device.type != "cpu" for t in tensors)
        ):
            return

        def weight(lin: ReplicatedLinear) -> torch.Tensor:
            return lin.packed if lin.packed is not None else lin.weight

        # Slot order of decode_layer.cpp's ``Slot`` enum; a lender fills the FFN's per step.
        ffn: list[torch.Tensor | None] = [None] * 4
        if isinstance(mlp, LlamaMLP):
            ffn = [
                weight(mlp.gate_up_proj),
                mlp.gate_up_proj.bias,
                weight(mlp.down_proj),
                mlp.down_proj.bias,
            ]
        weights: list[torch.Tensor | None] = [
            norms[0].weight,
            weight(attn.qkv_proj),
            attn.qkv_proj.bias,
            weight(attn.o_proj),
            attn.o_proj.bias,
            norms[1].weight,
            *ffn,
        ]
        self.fused = FusedDecodeArgs(weights, attn.num_heads, norms[0].eps, lender)

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
        normed, residual = self.attend(rope, hidden, residual, kv, meta, core)
        return self.mlp(normed), residual

    def attend(
        self,
        rope: Rope,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv: LayerKV,
        meta: AttentionMetadata,
        core: AttentionCore,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` up to the FFN: (the FFN's normed input, residual stream)."""
        if residual is None:
            residual = hidden
            normed = self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm.add_forward(hidden, residual)
        attn = self.self_attn(rope, normed, kv, meta, core)
        return self.post_attention_layernorm.add_forward(attn, residual)

    def fused_decode(
        self,
        rope: Rope,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv: LayerKV,
        meta: AttentionMetadata,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` of a pure-decode step through the CPU attention kernel, as one C++ op: the
        same kernels in the same order (bit-identical results), without ~17 eager dispatches."""
        fused = self.fused
        assert fused is not None
        weights = fused.weights
        if fused.lender is not None:
            weights = weights[:6] + list(fused.lender.lend())
        try:
            return kernels.decode_layer(
                hidden,
                residual,
                weights,
                kv[0],
                kv[1],
                meta.slot_mapping,
                meta.block_tables,
                meta.seq_lens,
                rope[0],
                rope[1],
                fused.num_heads,
                fused.eps,
                scale,
            )
        finally:
            if fused.lender is not None:
                fused.lender.give_back()


class LlamaModel(nn.Module):
    """Embedding, decoder layers ``layers`` (global indices) and final norm; a pipeline stage
    holds the embedding only if it is the first and the norm only if it is the last."""

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        tp: CommGroup,
        dtype: torch.dtype,
        device: torch.device,
        layers: range,
        mlp_factory: MlpFactory | None = None,
    ) -> None:
        super().__init__()
        self.layer_range = layers
        self.embed_tokens = (
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype, device)
            if layers.start == 0
            else None
        )
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope, dtype, device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                cfg, tp, dtype, device, mlp_factory(i) if mlp_factory is not None else None
            )
            for i in layers
        )
        self.norm = (
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
            if layers.stop == cfg.num_layers
            else None
        )


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
        layers: range | None = None,
        mlp_factory: MlpFactory | None = None,
    ) -> None:
        """``layers``: the global decoder layers this rank holds (a pipeline stage; default all);
        ``mlp_factory``: the FFN of each layer when a policy supplies it (default LlamaMLP)."""
        super().__init__()
        self.config = cfg
        self.tp = tp
        layers = range(cfg.num_layers) if layers is None else layers
        self.is_first_stage = layers.start == 0
        self.is_last_stage = layers.stop == cfg.num_layers
        # Every layer when all of them can run as the fused decode op (pack_weights decides).
        self.fused_layers: list[LlamaDecoderLayer] = []
        self.lenders: list[LendsFfn] = []  # the fused layers' policy FFNs, asked every step
        self.fused_choice: object = None  # fused_ops.FusedChoice on CUDA, once chosen
        self.layer_runner: LayerRunner | None = None  # a policy's layer loop (set after build)
        self.model = LlamaModel(cfg, max_positions, tp, dtype, device, layers, mlp_factory)
        self.lm_head = (
            ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype, device)
            if self.is_last_stage
            else None
        )
        embed = self.model.embed_tokens
        if cfg.tie_word_embeddings and self.lm_head is not None and embed is not None:
            self.lm_head.weight = embed.weight

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
        """Hidden states [T, hidden] after the final norm (the whole model on this rank)."""
        hidden, residual = self.forward_layers(input_ids, positions, kv_caches, meta, core)
        return self.final_norm(hidden, residual)

    def forward_layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[LayerKV],
        meta: AttentionMetadata,
        core: AttentionCore,
        carry: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden, residual stream) after this rank's layers; ``carry`` is what the previous
        pipeline stage sent (the first stage embeds ``input_ids`` instead)."""
        rope = self.model.rotary.table(positions)
        residual: torch.Tensor | None
        if carry is None:
            assert self.model.embed_tokens is not None, "only the first stage embeds tokens"
            hidden, residual = self.model.embed_tokens(input_ids), None
        else:
            hidden, residual = carry
        scale = self._fused_decode_scale(hidden, meta, core)
        if scale is not None:
            for fused, kv in zip(self.fused_layers, kv_caches, strict=True):
                hidden, residual = fused.fused_decode(rope, hidden, residual, kv, meta, scale)
            return hidden, residual
        if self.layer_runner is not None:
            layers = [layer for layer in self.model.layers if isinstance(layer, LlamaDecoderLayer)]
            out = self.layer_runner(layers, rope, hidden, residual, kv_caches, meta, core)
            if out is not None:
                return out
        for layer, kv in zip(self.model.layers, kv_caches, strict=True):
            hidden, residual = layer(rope, hidden, residual, kv, meta, core)
        return hidden, residual

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The last stage's final RMSNorm (adding the residual stream)."""
        assert self.model.norm is not None, "only the last stage has the final norm"
        if residual is None:  # a model without layers
            return self.model.norm(hidden)
        return self.model.norm.add_forward(hidden, residual)[0]

    def _fused_decode_scale(
        self, hidden: torch.Tensor, meta: AttentionMetadata, core: AttentionCore
    ) -> float | None:
        """The attention scale when every layer of this step can run as ``kernels.decode_layer``:
        all tokens are decodes (no prefill chunk, no padding), attention is the CPU backend's
        kernel (not wrapped, e.g. by Ulysses), and every layer was prepared for it. Else None."""
        if (
            meta.num_decodes != hidden.shape[0]
            or meta.num_padding
            or not self.fused_layers
            or not isinstance(core, CpuAttention)
            or not kernels.usable(hidden)
            or not all(lender.fusable() for lender in self.lenders)
        ):
            return None
        return core.scale

    def pack_weights(self, packing: str = "auto") -> None:
        """Pre-pack every matmul weight for CPU inference when ``packing`` (or, for ``auto``,
        cpu_features.choose_packing) says oneDNN, then cache each layer's arguments of the fused
        decode op (they point at the packed weights, or the plain ones)."""
        if packing == "auto":
            param = next(self.parameters())
            packing = choose_packing(param.dtype, param.device)
        for module in self.modules():
            pack = getattr(module, "pack_weights", None)
            if module is not self and callable(pack):
                pack(packing)
        layers = [layer for layer in self.model.layers if isinstance(layer, LlamaDecoderLayer)]
        for layer in layers:
            layer.prepare_fused_decode(self.tp)
        ready = all(layer.fused is not None for layer in layers)
        self.fused_layers = layers if ready else []
        self.lenders = [
            layer.fused.lender
            for layer in self.fused_layers
            if layer.fused is not None and layer.fused.lender is not None
        ]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocab logits on the TP group's first rank; None elsewhere."""
        assert self.lm_head is not None, "only the last stage has the LM head"
        return self.lm_head.logits(hidden)
