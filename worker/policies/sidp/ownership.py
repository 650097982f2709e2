"""Which replica owns each layer's FFN, the order remote layers are fetched in, and what each rank
holds (SiDP §4.1, §4.2).

Pure arithmetic over one frozen dataclass: no torch, no processes, so every rule is tested for
any ``dp`` and layer count.
"""

from __future__ import annotations

from dataclasses import dataclass

from gearshift.worker.model.config import ModelConfig


@dataclass(frozen=True)
class Ownership:
    """FFN ownership of ``num_layers`` decoder layers over ``dp`` replicas."""

    dp: int
    num_layers: int

    def owner(self, layer: int) -> int:
        """§4.1: layer ℓ's FFN lives on replica ℓ mod dp, so every cycle of dp consecutive
        layers holds exactly one layer per replica."""
        return layer % self.dp

    def owned(self, replica: int) -> list[int]:
        return [layer for layer in range(self.num_layers) if self.owner(layer) == replica]

    def remote(self, replica: int) -> list[int]:
        return [layer for layer in range(self.num_layers) if self.owner(layer) != replica]

    def cycles(self) -> list[range]:
        """The d-layer cycles [c, c + dp) (the last one may be cut short by the layer count)."""
        return [
            range(c, min(c + self.dp, self.num_layers)) for c in range(0, self.num_layers, self.dp)
        ]

    def fetch_slots(self, replica: int, peak_shifting: bool) -> list[list[int | None]]:
        """Per cycle, the layers ``replica`` fetches at prefetch index 0 .. dp-2 (None where the
        cycle is cut short).

        §4.2 peak shifting: in the cycle starting at layer c, replica r starts at c + r (its
        own layer) and wraps within the cycle, so it fetches c + (r + 1 + i) mod dp at index i.
        At each index the replicas fetch different layers, so no owner serves everyone at once.
        Without it every replica fetches in layer order (the incast the paper avoids).
        """
        out: list[list[int | None]] = []
        for cycle in self.cycles():
            c = cycle.start
            if peak_shifting:
                wanted = [c + (replica + 1 + i) % self.dp for i in range(self.dp - 1)]
            else:
                wanted = [c + j for j in range(self.dp) if j != replica]
            out.append([layer if layer in cycle else None for layer in wanted])
        return out

    def fetch_order(self, replica: int, peak_shifting: bool) -> list[int]:
        """The remote layers in the order the housekeeper fetches them, one forward pass."""
        return [
            layer
            for cycle in self.fetch_slots(replica, peak_shifting)
            for layer in cycle
            if layer is not None
        ]


@dataclass(frozen=True)
class WeightBytes:
    """Weight bytes of one rank of a replica, from the model config alone (§4.1, §4.4)."""

    replicated: int  # embeddings, attention, norms, LM head: every replica holds its TP shard
    ffn_layer: int  # one rank's TP shard of one layer's FFN (gate, up, down and their biases)
    owned_layers: int
    slots: int

    @property
    def owned_ffn(self) -> int:
        return self.owned_layers * self.ffn_layer

    @property
    def slot_bytes(self) -> int:
        return self.slots * self.ffn_layer

    @property
    def resident(self) -> int:
        """Replicated parts + owned FFN layers + WaS cache slots."""
        return self.replicated + self.owned_ffn + self.slot_bytes

    def freed(self, num_layers: int) -> int:
        """What plain DP holds and this rank does not: the remote FFN layers less the slots."""
        return (num_layers - self.owned_layers) * self.ffn_layer - self.slot_bytes


def ffn_layer_numel(cfg: ModelConfig, tp: int = 1) -> int:
    """One TP rank's share of a layer's FFN: gate, up (and their biases) split by output rows,
    down by input columns; down's bias is whole on every rank (added once, by TP rank 0)."""
    h, i = cfg.hidden_size, cfg.intermediate_size // tp
    return 3 * h * i + ((2 * i + h) if cfg.mlp_bias else 0)


def weight_bytes(
    cfg: ModelConfig,
    ownership: Ownership,
    replica: int,
    slots: int,
    element_size: int,
    tp: int = 1,
) -> WeightBytes:
    """The formula the tests hold a loaded rank (one of the replica's ``tp`` ranks) to."""
    h, d = cfg.hidden_size, cfg.head_dim
    # Query heads split over TP; KV heads split, or one replicated head per rank (GQA).
    q = cfg.num_heads // tp * d
    kv = (cfg.num_kv_heads // tp if tp < cfg.num_kv_heads else 1) * d
    attn = h * (q + 2 * kv) + q * h
    attn += (q + 2 * kv) if cfg.qkv_bias else 0
    attn += h if cfg.o_bias else 0
    attn += 2 * d if cfg.qk_norm else 0
    per_layer = attn + 2 * h  # two RMSNorms
    embed = -(-cfg.vocab_size // tp) * h  # vocab rows split over TP (padded)
    replicated = embed + cfg.num_layers * per_layer + h  # final norm
    if not cfg.tie_word_embeddings:
        replicated += embed
    return WeightBytes(
        replicated=replicated * element_size,
        ffn_layer=ffn_layer_numel(cfg, tp) * element_size,
        owned_layers=len(ownership.owned(replica)),
        slots=slots,
    )
