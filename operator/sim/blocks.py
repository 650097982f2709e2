"""The engine's ``BlockManager`` with its per-block state kept only for blocks ever handed out.

A planned layout can hold tens of millions of KV blocks (a small model on an H200: 20 M blocks of
16 tokens per rank). The engine's manager builds a free list, a reference count and a hash slot
for every block up front: for ``gearshift plan`` that was 2.5 GB and 10 s per replica and rate
point (issue 30, item 5), for blocks a 300-request trace never touches.

Here the blocks never handed out are a counter. With prefix caching off (a trace has no text to
match) every freed block goes to the front of the engine's free list, so the order the engine
hands blocks out in is: the freed ones, most recently freed first, then the untouched ones in id
order; ``_LazyFree`` keeps exactly that order, so every allocation gets the same block id and
succeeds or fails exactly as in the engine's manager (tested against it:
``tests/sim/test_sim_blocks.py``).
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from typing import Any, SupportsIndex

from gearshift.worker.kv.block_manager import BlockManager
from gearshift.worker.policies.seesaw.pages import PageAllocator


class _LazyFree(OrderedDict[int, None]):
    """The free list: freed blocks (an ``OrderedDict``, front first) before ``[fresh, total)``."""

    def __init__(self, total: int) -> None:
        super().__init__()
        self.fresh = 0
        self.total = total

    def __len__(self) -> int:
        return super().__len__() + self.total - self.fresh

    def popitem(self, last: bool = True) -> tuple[int, None]:
        if last:
            raise NotImplementedError("the engine takes free blocks from the front only")
        if super().__len__():
            return super().popitem(last=False)
        if self.fresh >= self.total:
            raise KeyError("popitem(): no free block")
        self.fresh += 1
        return self.fresh - 1, None

    def __delitem__(self, block: Any) -> None:
        if block >= self.fresh:  # only a prefix hit removes a chosen block; none without cache
            raise NotImplementedError("an untouched block is never taken out of order")
        super().__delitem__(block)


class SimBlockManager(BlockManager):
    """``BlockManager`` without prefix caching, its per-block state allocated on first use."""

    def __init__(
        self, num_blocks: int, block_size: int, max_seqs: int, max_blocks_per_seq: int
    ) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV cache has no room for a single block")
        super().__init__(1, block_size, max_seqs, max_blocks_per_seq, enable_prefix_caching=False)
        self.num_blocks = num_blocks
        self.ref_counts: defaultdict[int, int] = defaultdict(int)  # type: ignore[assignment]
        self.block_hash: defaultdict[int, int | None] = defaultdict(type(None))  # type: ignore[assignment]
        self.free = _LazyFree(num_blocks)

    def leaked_blocks(self) -> list[int]:
        return sorted(b for b, n in self.ref_counts.items() if n)


class _LazyStack(list[int]):
    """A page allocator's free stack ``[total - 1, ..., 0]``: its untouched part a counter."""

    def __init__(self, total: int) -> None:
        super().__init__()
        self.fresh = 0
        self.total = total

    def __len__(self) -> int:
        return super().__len__() + self.total - self.fresh

    def pop(self, index: SupportsIndex = -1) -> int:
        if index != -1:
            raise NotImplementedError("the allocator pops from the top only")
        if super().__len__():
            return super().pop()
        if self.fresh >= self.total:
            raise IndexError("pop from an empty free list")
        self.fresh += 1
        return self.fresh - 1


class SimPageAllocator(PageAllocator):
    """Seesaw's host page allocator with the untouched pages a counter (80 GiB of host store per
    GPU is tens of millions of pages for a small model); hands out the same pages in the same
    order (tested: ``tests/sim/test_sim_blocks.py``)."""

    def __init__(self, num_pages: int) -> None:
        super().__init__(0)
        self.num_pages = num_pages
        self.free = _LazyStack(num_pages)
