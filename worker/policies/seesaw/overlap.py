"""Which device blocks of one gear share memory with which blocks of the other (rank_hook.DeviceKV).

Each rank's device KV is one buffer that both gears view from its start, as
[layers][k, v][blocks][heads][block_size][head_dim] with their own layers and heads per rank. In
units of one head's block (block_size x head_dim elements), gear g's block b of local layer l and
K/V plane kv starts at ``((2 l + kv) N + b) H_g`` and is ``H_g`` long (N blocks, H_g heads). A
swap-in that writes the decode gear's view while the prefill gear still runs (§5.2, Fig. 8: swap-in
overlaps prefill) may only write decode blocks none of whose memory any prefill block still in use
covers, on any rank. Torch-free: the leader (and the simulator) run without torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ViewShape:
    """One gear's view on one rank: its local decoder layers and KV heads."""

    layers: int
    heads: int


def _covered(start: int, length: int, other: ViewShape, num_blocks: int) -> set[int]:
    """Blocks of view ``other`` with memory in [start, start + length) (head-block units)."""
    plane = num_blocks * other.heads  # one layer's keys (or values) for every block
    end = min(start + length, 2 * other.layers * plane)  # past its extent: nothing of it
    out: set[int] = set()
    at = start
    while at < end:
        index, offset = divmod(at, plane)
        block = offset // other.heads
        out.add(block)
        at = index * plane + (block + 1) * other.heads
    return out


def clashes_of(writer: ViewShape, reader: ViewShape, num_blocks: int, block: int) -> set[int]:
    """Blocks of ``reader``'s view on one rank that share memory with ``writer``'s ``block``."""
    hit: set[int] = set()
    for plane in range(2 * writer.layers):
        start = (plane * num_blocks + block) * writer.heads
        hit |= _covered(start, writer.heads, reader, num_blocks)
    return hit


class GearOverlap:
    """Decode-gear blocks against prefill-gear blocks, over every rank of the group."""

    def __init__(self, ranks: list[tuple[ViewShape, ViewShape]], num_blocks: int = 0) -> None:
        # (prefill view, decode view) per rank; only distinct pairs are worked out.
        self.ranks = sorted(set(ranks), key=lambda r: (r[0].layers, r[0].heads, r[1].layers))
        self.num_blocks = num_blocks  # set once the engine has sized the KV cache
        self._clashes: dict[int, frozenset[int]] = {}

    def clashes(self, decode_block: int) -> frozenset[int]:
        """Prefill-gear blocks sharing memory with ``decode_block`` on some rank (worked out
        on first use: 2 x layers intervals per rank shape)."""
        hit = self._clashes.get(decode_block)
        if hit is None:
            found: set[int] = set()
            for prefill, decode in self.ranks:
                found |= clashes_of(decode, prefill, self.num_blocks, decode_block)
            hit = self._clashes[decode_block] = frozenset(found)
        return hit
