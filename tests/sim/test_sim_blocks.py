"""The simulator's lazy KV bookkeeping (issue 30, item 5) hands out the same blocks and pages in
the same order, and fails the same allocations, as the engine's own."""

from __future__ import annotations

import random

from gearshift.operator.sim.blocks import SimBlockManager, SimPageAllocator
from gearshift.worker.kv.block_manager import BlockManager, BlockTable
from gearshift.worker.policies.seesaw.pages import PageAllocator


def test_blocks_match_the_engines_manager_step_for_step() -> None:
    rng = random.Random(0)
    eager = BlockManager(64, 4, 16, 64, enable_prefix_caching=False)
    lazy = SimBlockManager(64, 4, 16, 64)
    tables: list[tuple[BlockTable, BlockTable]] = []
    for _ in range(2000):
        if tables and rng.random() < 0.35:
            a, b = tables.pop(rng.randrange(len(tables)))
            eager.free_table(a)
            lazy.free_table(b)
        else:
            if not tables or rng.random() < 0.3:
                if len(tables) >= 16:
                    continue
                tables.append((BlockTable(), BlockTable()))
            a, b = tables[rng.randrange(len(tables))]
            want = len(a.block_ids) * 4 + rng.randint(1, 12)
            assert eager.allocate(a, want) == lazy.allocate(b, want)
        assert [a.block_ids for a, _ in tables] == [b.block_ids for _, b in tables]
        assert eager.num_free_blocks == lazy.num_free_blocks
    assert sorted(eager.leaked_blocks()) == lazy.leaked_blocks()


def test_a_huge_cache_costs_nothing_up_front() -> None:
    lazy = SimBlockManager(50_000_000, 16, 256, 2048)
    assert lazy.num_free_blocks == 50_000_000 and len(lazy.ref_counts) == 0
    t = BlockTable()
    assert lazy.allocate(t, 40) and t.block_ids == [0, 1, 2]
    lazy.free_table(t)
    assert lazy.leaked_blocks() == [] and lazy.num_free_blocks == 50_000_000


def test_pages_match_the_engines_allocator() -> None:
    rng = random.Random(1)
    eager, lazy = PageAllocator(100), SimPageAllocator(100)
    held: list[str] = []
    for i in range(1000):
        if held and rng.random() < 0.4:
            rid = held.pop(rng.randrange(len(held)))
            assert eager.release(rid) == lazy.release(rid)
        else:
            rid, n = f"r{i}", rng.randint(1, 20)
            got = eager.allocate(rid, n)
            assert got == lazy.allocate(rid, n)
            if got is not None:
                held.append(rid)
        assert eager.used == lazy.used and eager.usage == lazy.usage
