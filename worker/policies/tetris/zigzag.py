"""Zig-zag sharding of one chunk over a ring of N members (Tetris §2.3).

The chunk's tokens are cut into 2N contiguous shards S_0 … S_2N−1 and member i holds
(S_i, S_2N−1−i): under a causal mask each member then does the same attention work. Lengths that
do not divide by 2N give the first ``length % 2N`` shards one token more; a chunk shorter than 2N
tokens leaves some shards empty.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ZigZag:
    """Which token rows of a chunk of ``length`` tokens each of ``members`` ring members holds."""

    length: int
    members: int

    def __post_init__(self) -> None:
        if self.members < 1 or self.length < 0:
            raise ValueError(f"zig-zag needs members >= 1 and length >= 0, got {self}")

    @functools.cached_property
    def bounds(self) -> tuple[int, ...]:
        """2N + 1 offsets: shard s is rows [bounds[s], bounds[s + 1])."""
        n = self.members
        base, extra = divmod(self.length, 2 * n)
        # Extra-token order: every member's first shard, then second shards from member 0 on.
        order = list(range(n)) + list(range(2 * n - 1, n - 1, -1))
        sizes = [base] * (2 * n)
        for shard in order[:extra]:
            sizes[shard] += 1
        out = [0]
        for size in sizes:
            out.append(out[-1] + size)
        return tuple(out)

    def shards(self, member: int) -> tuple[int, int]:
        """The two shard indices member i holds, in position order: (i, 2N − 1 − i)."""
        return member, 2 * self.members - 1 - member

    def span(self, shard: int) -> tuple[int, int]:
        return self.bounds[shard], self.bounds[shard + 1]

    def local_length(self, member: int) -> int:
        return sum(hi - lo for lo, hi in map(self.span, self.shards(member)))

    def positions(self, member: int) -> list[int]:
        """Chunk offsets of the member's local rows, in local order."""
        return [p for s in self.shards(member) for p in range(*self.span(s))]

    def split(self, x: torch.Tensor, member: int) -> torch.Tensor:
        """The member's local rows of a whole chunk's tensor (dim 0 = tokens)."""
        return torch.cat([x[slice(*self.span(s))] for s in self.shards(member)])

    def join(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """The whole chunk's rows from every member's local rows (``parts`` in member order)."""
        pieces: list[torch.Tensor] = [parts[0][:0]] * (2 * self.members)
        for member, part in enumerate(parts):
            first, second = self.shards(member)
            n = self.span(first)[1] - self.span(first)[0]
            pieces[first], pieces[second] = part[:n], part[n:]
        return torch.cat(pieces)


def even_split(total: int, members: int) -> tuple[int, ...]:
    """``total`` tokens spread as evenly as possible over ``members`` (first ones get the extra):
    how history KV is rebalanced onto a chunk's group (CDSP §4.1)."""
    base, extra = divmod(total, members)
    return tuple(base + (1 if i < extra else 0) for i in range(members))
