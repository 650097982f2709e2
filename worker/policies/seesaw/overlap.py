"""Which device blocks of one gear share memory with which blocks of the other (rank_hook.DeviceKV).

Each rank's device KV is one buffer of N slabs, one per block id, each as large as the largest
gear's block on that rank (every local layer, keys and values, every local KV head). Gear g's
block b lies inside slab b, as [layers_g][k, v][heads_g][block_size][head_dim] from the slab's
start: in units of one head's block (block_size x head_dim elements) it spans
``[b S, b S + 2 L_g H_g)`` with ``S = max over gears of 2 L H``. So block b of one gear shares
memory with block b of the other and with no other block, on every rank. A swap-in that writes
the decode gear's view while the prefill gear still runs (§5.2, Fig. 8: swap-in overlaps prefill)
may therefore write any decode block whose prefill block of the same id is not in use. Torch-free:
the leader (and the simulator) run without torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ViewShape:
    """One gear's view on one rank: its local decoder layers and KV heads."""

    layers: int
    heads: int

    @property
    def units(self) -> int:
        """Head-blocks one block of this view takes (keys and values of every local layer)."""
        return 2 * self.layers * self.heads


def clashes_of(writer: ViewShape, reader: ViewShape, num_blocks: int, block: int) -> set[int]:
    """Blocks of ``reader``'s view on one rank that share memory with ``writer``'s ``block``:
    both views start at the slab's start, so a block meets exactly the other's block of the
    same id (if both views hold anything on this rank)."""
    if not 0 <= block < num_blocks:
        raise ValueError(f"block {block} is outside the cache ({num_blocks} blocks)")
    return {block} if writer.units and reader.units else set()


class GearOverlap:
    """Decode-gear blocks against prefill-gear blocks, over every rank of the group."""

    def __init__(self, ranks: list[tuple[ViewShape, ViewShape]], num_blocks: int = 0) -> None:
        # (prefill view, decode view) per rank; only distinct pairs are worked out.
        self.ranks = sorted(set(ranks), key=lambda r: (r[0].layers, r[0].heads, r[1].layers))
        self.num_blocks = num_blocks  # set once the engine has sized the KV cache

    def clashes(self, decode_block: int) -> frozenset[int]:
        """Prefill-gear blocks sharing memory with ``decode_block`` on some rank."""
        found: set[int] = set()
        for prefill, decode in self.ranks:
            found |= clashes_of(decode, prefill, self.num_blocks, decode_block)
        return frozenset(found)
