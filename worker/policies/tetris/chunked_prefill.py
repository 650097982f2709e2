"""Running one request's CDSP chunk plan on the prefill pool (Tetris §4.1, Fig. 5–6).

A plan is a list of chunks, each with its instance group; each group contains the previous one
(§4.1), so the pool's members only ever join. For every chunk:

1. The KV of the tokens before it (the history) is rebalanced evenly onto the chunk's group
   (``rebalance.py``): members that just joined receive their share by point-to-point from the
   members that hold more than theirs, layer by layer (layer i+1's after layer i's ring, Fig.
   6-b), while the chunk's earlier layers compute.
   History attention does not depend on the order of the history's tokens (all precede the
   chunk; keys already carry their RoPE rotation), so any even split is exact; the
   token positions travel with the KV so the request's KV can be handed to a decode instance in
   prompt order.
2. The chunk's tokens are zig-zag sharded over the group and the whole model runs on each
   member's rows, with ``RingCore`` as the attention: zig-zag pass-KV ring attention over the
   chunk plus the member's history share (``ring.ring_attention_with_history``).
3. Each member appends its rows' KV (every layer) to its holding.

The member that holds the prompt's last token returns that token's logits (the first output
token comes from them). Every pool member calls ``run_chunk_plan`` with the same plan; a member
sits a chunk out until its group includes it. Everything stays on the model's device: the
prompt's rows, the holding, the ring's blocks (``Pool``: the pool group's p2p channel stages
them through host memory only where the group runs over gloo).

The hand-off of the finished KV to a decode instance is ``handoff.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

from gearshift.worker.attention.core import AttentionCore
from gearshift.worker.attention.metadata import AttentionMetadata
from gearshift.worker.comm import CommGroup
from gearshift.worker.model.llama import LlamaForCausalLM
from gearshift.worker.p2p import P2P
from gearshift.worker.policies.tetris.rebalance import Holding, Rebalanced, rebalance
from gearshift.worker.policies.tetris.ring import History, Ring, ring_attention_with_history
from gearshift.worker.policies.tetris.zigzag import ZigZag, even_split

__all__ = ["Holding", "PlannedChunk", "Pool", "PrefillResult", "RingCore", "run_chunk_plan"]


@dataclass(frozen=True)
class Pool:
    """The prefill pool as one member sees it: its group (``comm``), the group's point-to-point
    channel (None for a pool of one) and the attention core ring steps run on (the rank's
    selected backend; its scale is the model's)."""

    comm: CommGroup
    channel: P2P | None
    core: AttentionCore


@dataclass(frozen=True)
class PlannedChunk:
    """One chunk of a plan as the pool runs it: its tokens and its group (pool ranks in ring
    order; it contains the previous chunk's group)."""

    length: int
    group: tuple[int, ...]


def check_plan(plan: list[PlannedChunk], prompt_length: int, pool_size: int) -> None:
    """Refuse a plan the pool cannot run, naming what is wrong."""
    if not plan:
        raise ValueError("a chunk plan needs at least one chunk")
    if sum(c.length for c in plan) != prompt_length:
        raise ValueError(
            f"the chunks' lengths add up to {sum(c.length for c in plan)}, the prompt has "
            f"{prompt_length} tokens"
        )
    previous: set[int] = set()
    for i, chunk in enumerate(plan):
        members = set(chunk.group)
        if chunk.length < 1 or len(members) != len(chunk.group) or not members:
            raise ValueError(f"chunk {i}: needs tokens and distinct members, got {chunk}")
        if any(not 0 <= m < pool_size for m in members):
            raise ValueError(f"chunk {i}: members {chunk.group} outside a pool of {pool_size}")
        if not previous <= members:
            raise ValueError(f"chunk {i}: its group {chunk.group} drops a previous member")
        previous = members


class _LayerHistory:
    """What ``RingCore`` gets as a layer's ``kv``: the member's history for the layer (waited
    for when the layer's attention asks, so later layers' rebalancing overlaps this one's
    compute), and the chunk's local k/v once the layer has run."""

    def __init__(self, history: Rebalanced, layer: int) -> None:
        self.history, self.index = history, layer
        self.chunk: tuple[torch.Tensor, torch.Tensor] | None = None

    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.history.layer(self.index)
        return rows[:, 0], rows[:, 1]


class RingCore:
    """The attention of one chunk on one ring member (an ``AttentionCore``): zig-zag ring
    attention over the chunk and the history rebalanced onto the ring."""

    def __init__(
        self,
        ring: Ring,
        layout: ZigZag,
        lengths: tuple[int, ...],
        scale: float,
        core: AttentionCore,
        on_layer: Callable[[torch.Tensor], None] | None = None,
        poll: Callable[[], None] | None = None,
    ):
        self.ring, self.layout, self.lengths, self.core = ring, layout, lengths, core
        self.scale = scale
        self.on_layer = on_layer
        self.poll = poll

    def forward_lse(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: Any, meta: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = cast(_LayerHistory, kv)
        layer.chunk = (k, v)
        if self.poll is not None:
            self.poll()
        if self.on_layer is not None:
            # The layer's KV is final now (history landed, chunk rows projected): it can leave
            # while this layer's attention and the later layers run (layerwise_transfer).
            rows = layer.history.layer(layer.index)
            self.on_layer(torch.cat((rows, torch.stack((k, v), dim=1))))
        history = History(*layer.kv(), self.lengths)
        out = ring_attention_with_history(
            q, k, v, history, self.ring, self.layout, self.scale, self.core, f"ring L{layer.index}"
        )
        # Fig. 6-b: the ring's channel is free again, the next layer's history goes now.
        layer.history.post(layer.index + 1)
        return out

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: Any, meta: Any
    ) -> torch.Tensor:
        return self.forward_lse(q, k, v, kv, meta)[0]


def _metadata(tokens: int, device: torch.device) -> AttentionMetadata:
    """One prefill chunk of ``tokens`` rows; ``RingCore`` reads none of it (the model only
    checks that the step is not all decodes)."""
    empty = torch.empty(0, dtype=torch.int64, device=device)
    return AttentionMetadata(
        num_decodes=0,
        slot_mapping=torch.zeros(tokens, dtype=torch.int64, device=device),
        block_tables=empty.view(0, 0),
        seq_lens=empty,
        max_decode_seq_len=0,
        prefill_starts=(0,),
        prefill_query_lens=(tokens,),
        prefill_seq_lens=(tokens,),
    )


@dataclass
class PrefillResult:
    """This member's share of the request's KV, and the last prompt token's logits on the
    member that computed them (None elsewhere)."""

    holding: Holding
    last_logits: torch.Tensor | None


@torch.no_grad()
def run_chunk_plan(
    model: LlamaForCausalLM,
    pool: Pool,
    plan: list[PlannedChunk],
    prompt: torch.Tensor,
    timings: list[float] | None = None,
    on_layer: Callable[[torch.Tensor], None] | None = None,
    poll: Callable[[], None] | None = None,
) -> PrefillResult:
    """Prefill ``prompt`` (int64 [L]) chunk by chunk over the pool (§4.1). ``model`` is this
    member's model: the whole model at TP 1, or this TP rank's head shard of an instance of
    TP > 1 (the pool then joins the same TP rank of every instance, and the model all-reduces
    in its instance).
    ``timings`` gets each chunk's seconds on this member (rebalance included; 0 when it sat the
    chunk out). ``on_layer`` gets, during the plan's last chunk, each layer's final rows of
    this member ([n, 2, Hkv, D], in the order of the returned holding) as soon as the layer has
    projected them (layer-wise hand-off). ``poll`` is called at every layer of every chunk (the
    member's messages that must not wait for the prefill to end)."""
    comm = pool.comm
    check_plan(plan, int(prompt.shape[0]), comm.size)
    cfg = model.config
    layers = len(model.model.layers)
    weight = next(model.parameters())
    device = weight.device
    prompt = prompt.to(device)
    holding = Holding.empty(layers, model.num_kv_heads, cfg.head_dim, weight.dtype, device)
    counts: dict[int, int] = {}
    done = 0
    last_logits = None
    for chunk in plan:
        if comm.rank not in chunk.group:
            counts = _after(counts, chunk)
            done += chunk.length
            if timings is not None:
                timings.append(0.0)
            continue
        started = time.perf_counter()
        ring = Ring(comm, chunk.group, pool.channel if len(chunk.group) > 1 else None)
        history = rebalance(holding, counts, ring)  # layer 0 posted; the rest layer by layer
        lengths = even_split(done, ring.size)
        layout = ZigZag(chunk.length, ring.size)
        local = layout.positions(ring.index)
        rows = torch.tensor(local, dtype=torch.int64, device=device) + done
        stores = [_LayerHistory(history, i) for i in range(layers)]
        last_chunk = on_layer if chunk is plan[-1] else None
        core = RingCore(ring, layout, lengths, cfg.head_dim**-0.5, pool.core, last_chunk, poll)
        hidden = model(prompt[rows], rows, cast(Any, stores), _metadata(len(rows), device), core)
        holding = history.finish()
        if len(rows):
            fresh = torch.stack(
                [torch.stack(s.chunk, dim=1) for s in stores if s.chunk is not None], dim=1
            )
            holding = Holding(torch.cat((holding.kv, fresh)), torch.cat((holding.positions, rows)))
        last = int(prompt.shape[0]) - 1 - done
        if last in local:  # this member holds the prompt's last token
            row = hidden[local.index(last)].unsqueeze(0)
            last_logits = model.compute_logits(row)
        counts = _after(counts, chunk)
        done += chunk.length
        if timings is not None:
            timings.append(time.perf_counter() - started)
    return PrefillResult(holding, last_logits)


def _after(counts: dict[int, int], chunk: PlannedChunk) -> dict[int, int]:
    """Every member's row count after ``chunk``: the history rebalanced, plus its chunk rows."""
    total = sum(counts.values())
    layout = ZigZag(chunk.length, len(chunk.group))
    shares = even_split(total, len(chunk.group))
    return {m: shares[i] + layout.local_length(i) for i, m in enumerate(chunk.group)}


def rows_after(plan: list[PlannedChunk]) -> dict[int, int]:
    """How many KV rows each member of the last group holds once ``plan`` has run."""
    counts: dict[int, int] = {}
    for chunk in plan:
        counts = _after(counts, chunk)
    return counts


def last_token_member(plan: list[PlannedChunk]) -> int:
    """The pool member that computes the last prompt token (and so the first output token)."""
    last = plan[-1]
    layout = ZigZag(last.length, len(last.group))
    for i, member in enumerate(last.group):
        if last.length - 1 in layout.positions(i):
            return member
    raise AssertionError("the last chunk's last token belongs to no member")
