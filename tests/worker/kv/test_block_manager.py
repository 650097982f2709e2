"""Block manager: all-or-nothing allocation, prefix cache reuse and eviction, no leaks."""

from __future__ import annotations

from gearshift.worker.kv.block_manager import BlockManager, BlockTable


def _bm(blocks: int = 8, prefix: bool = True) -> BlockManager:
    return BlockManager(
        blocks, block_size=4, max_seqs=4, max_blocks_per_seq=8, enable_prefix_caching=prefix
    )


def test_allocation_is_all_or_nothing_and_rows_mirror_tables():
    bm = _bm(4)
    a, b = BlockTable(), BlockTable()
    assert bm.allocate(a, 9)  # 3 blocks
    assert not bm.allocate(b, 8)  # needs 2, 1 free
    assert b.block_ids == [] and bm.num_free_blocks == 1
    assert list(bm.tables[a.row, :3]) == a.block_ids
    assert bm.allocate(a, 12) and len(a.block_ids) == 3  # still fits in 3 blocks
    bm.free_table(a)
    assert bm.num_free_blocks == 4 and bm.leaked_blocks() == [] and a.row == -1


def test_full_blocks_are_reused_by_a_matching_prefix_only():
    bm = _bm(8)
    tokens = list(range(10))
    a = BlockTable()
    bm.allocate(a, 10)
    bm.cache_full_blocks(a, tokens, 10)
    assert len(a.hashes) == 2  # the third block is partial
    hit = bm.match_prefix([*tokens[:8], 99, 98], 9)
    assert hit.block_ids == tuple(a.block_ids[:2])
    assert bm.match_prefix([0, 1, 2, 3, 7, 7, 7, 7], 8).block_ids == (a.block_ids[0],)
    # A different first block breaks the chain even if the second block's tokens match.
    assert bm.match_prefix([9, 1, 2, 3, *tokens[4:8]], 8).block_ids == ()
    b = BlockTable()
    assert bm.allocate(b, 10, hit)
    assert b.block_ids[:2] == a.block_ids[:2] and bm.ref_counts[a.block_ids[0]] == 2
    bm.free_table(a)
    bm.free_table(b)
    assert bm.leaked_blocks() == [] and bm.num_free_blocks == 8


def test_freed_cached_blocks_survive_until_their_slot_is_needed():
    bm = _bm(4)
    tokens = list(range(8))
    a = BlockTable()
    bm.allocate(a, 8)
    bm.cache_full_blocks(a, tokens, 8)
    bm.free_table(a)
    assert bm.match_prefix(tokens, 8).block_ids  # still cached while free
    big = BlockTable()
    assert bm.allocate(big, 16)  # takes every block, evicting the cached ones
    assert bm.match_prefix(tokens, 8).block_ids == ()
    bm.free_table(big)


def test_hit_on_a_free_cached_block_counts_against_free_space():
    bm = _bm(3)
    tokens = list(range(8))
    a = BlockTable()
    bm.allocate(a, 8)
    bm.cache_full_blocks(a, tokens, 8)
    bm.free_table(a)
    hit = bm.match_prefix(tokens, 8)
    b = BlockTable()
    # 2 cached blocks come back from the free list, leaving 1: 3 more blocks do not fit.
    assert not bm.allocate(b, 20, hit)
    assert bm.num_free_blocks == 3 and b.block_ids == []
    assert bm.allocate(b, 12, hit)
    bm.free_table(b)
    assert bm.leaked_blocks() == []


def test_prefix_caching_off_never_hits():
    bm = _bm(8, prefix=False)
    a = BlockTable()
    bm.allocate(a, 8)
    bm.cache_full_blocks(a, list(range(8)), 8)
    assert bm.match_prefix(list(range(8)), 8).block_ids == ()
    bm.free_table(a)


def test_reset_prefix_cache_hands_the_uncached_blocks_out_before_untouched_ones():
    bm = _bm(8)
    tokens = list(range(8))
    a = BlockTable()
    bm.allocate(a, 8)
    used = list(a.block_ids)
    bm.cache_full_blocks(a, tokens, 8)
    bm.free_table(a)
    bm.reset_prefix_cache()
    assert bm.match_prefix(tokens, 8).block_ids == ()
    b = BlockTable()
    bm.allocate(b, 8)
    assert sorted(b.block_ids) == sorted(used)  # warm blocks first, not blocks 2..7
    bm.free_table(b)


def test_retained_blocks_stay_allocated_after_their_table_is_freed_until_released():
    import pytest

    bm = _bm(4, prefix=False)
    a = BlockTable()
    assert bm.allocate(a, 8)
    held = list(a.block_ids)
    bm.retain(held)
    bm.free_table(a)  # e.g. the request was aborted while a copy still writes its blocks
    assert bm.num_free_blocks == 2 and sorted(bm.leaked_blocks()) == sorted(held)
    b = BlockTable()
    assert not bm.allocate(b, 9)  # the retained blocks are not handed out
    bm.release(held)
    assert bm.num_free_blocks == 4 and bm.leaked_blocks() == []
    with pytest.raises(ValueError, match="is free"):
        bm.retain([0])


def _cached(bm: BlockManager, tokens: list[int], salt: str = "") -> BlockTable:
    table = BlockTable()
    assert bm.allocate(table, len(tokens))
    bm.cache_full_blocks(table, tokens, len(tokens), salt)
    return table


def test_requests_with_different_salts_never_share_prefix_blocks():
    """vLLM's cache_salt: the salt goes into the first block's hash, so the whole chain differs."""
    bm = _bm(16)
    tokens = list(range(12))
    alice = _cached(bm, tokens, "alice")
    assert len(alice.hashes) == 3
    assert bm.match_prefix(tokens, 12, "alice").block_ids == tuple(alice.block_ids)
    assert bm.match_prefix(tokens, 12, "bob").block_ids == ()
    assert bm.match_prefix(tokens, 12).block_ids == ()  # nor unsalted requests
    plain = _cached(bm, tokens)
    assert not set(plain.hashes) & set(alice.hashes)
    assert bm.match_prefix(tokens, 12, "alice").block_ids == tuple(alice.block_ids)
    assert bm.match_prefix(tokens, 12).block_ids == tuple(plain.block_ids)
    # A salt is not a prefix of the prompt: "al" + "ice..." is not "alice".
    assert bm.match_prefix(tokens, 12, "al").block_ids == ()
    for t in (alice, plain):
        bm.free_table(t)
    assert bm.leaked_blocks() == []


def test_a_salted_table_keeps_its_chain_as_it_grows():
    bm = _bm(16)
    tokens = list(range(16))
    table = BlockTable()
    assert bm.allocate(table, 16)
    bm.cache_full_blocks(table, tokens, 8, "s")  # two blocks now, two more later (decode)
    bm.cache_full_blocks(table, tokens, 16, "s")
    assert bm.match_prefix(tokens, 16, "s").block_ids == tuple(table.block_ids)
    assert bm.match_prefix(tokens, 16, "t").block_ids == ()
    bm.free_table(table)


def test_block_hashes_are_keyed_per_block_manager():
    """Nobody outside can compute a block's hash (and craft a prompt colliding with it)."""
    tokens = list(range(8))
    one, two = _bm(8), _bm(8)
    assert _cached(one, tokens).hashes != _cached(two, tokens).hashes
    # 128-bit digests: no birthday collisions at 2**32 blocks, as 64-bit hashes would have.
    hashes = _cached(one, list(range(100, 108))).hashes
    assert all(0 <= h < 2**128 for h in hashes) and max(h.bit_length() for h in hashes) > 64


def test_allocate_where_takes_only_accepted_blocks_all_or_nothing():
    bm = BlockManager(num_blocks=8, block_size=4, max_seqs=2, max_blocks_per_seq=4)
    t = BlockTable()
    assert not bm.allocate_where(t, 12, lambda b: b in (1, 5))  # 3 blocks, 2 acceptable
    assert t.block_ids == [] and bm.num_free_blocks == 8 and t.row == -1
    assert bm.allocate_where(t, 12, lambda b: b % 2 == 1)
    assert t.block_ids == [1, 3, 5] and bm.num_free_blocks == 5
    assert list(bm.tables[t.row][:3]) == [1, 3, 5]
    bm.free_table(t)
    assert bm.leaked_blocks() == []


def test_a_block_hits_only_in_the_view_that_wrote_it_and_keeps_its_entry_across_views():
    """Seesaw's gears view the cache differently: a block cached while view 0 wrote it is no hit
    in view 1, survives view 1's work on other blocks, and hits again back in view 0."""
    bm = _bm(6)
    tokens = list(range(8))
    a = BlockTable()
    bm.allocate(a, 8)
    bm.cache_full_blocks(a, tokens, 8)  # written in view 0
    written = tuple(a.block_ids)
    bm.free_table(a)
    bm.view = 1
    assert bm.match_prefix(tokens, 8).block_ids == ()
    b = BlockTable()  # view 1 writes the same tokens elsewhere: a distinct entry
    bm.allocate(b, 8)
    bm.cache_full_blocks(b, tokens, 8)
    assert set(b.block_ids).isdisjoint(written)
    assert bm.match_prefix(tokens, 8).block_ids == tuple(b.block_ids)
    b_ids = list(b.block_ids)
    bm.free_table(b)
    bm.view = 0
    assert bm.match_prefix(tokens, 8).block_ids == written
    # A table that grows on in another view chains on: its later blocks hit in neither view
    # (each view still hits its own two blocks of the first eight tokens).
    c = BlockTable()
    bm.allocate(c, 16, bm.match_prefix(tokens, 8))
    bm.view = 1
    bm.cache_full_blocks(c, [*tokens, *range(20, 28)], 16)
    for view in (0, 1):
        bm.view = view
        hit = bm.match_prefix([*tokens, *range(20, 28)], 16).block_ids
        assert hit == (written if view == 0 else tuple(b_ids)) and len(c.block_ids) == 4
    bm.free_table(c)
    assert bm.leaked_blocks() == []


def test_more_holders_than_seats_get_rows_and_every_row_keeps_its_blocks():
    """A sequence holds its row while it holds KV, seated or not (a Tetris decode instance
    reserves for every request in transfer): past max_seqs the table grows, the earlier rows
    intact, and every row is handed back."""
    bm = _bm(32)  # max_seqs 4
    tables = [BlockTable() for _ in range(9)]
    for i, t in enumerate(tables):
        assert bm.allocate(t, 4 * (1 + i % 3)) if i % 2 else bm.allocate_where(t, 4, bool)
    assert sorted(t.row for t in tables) == list(range(9))
    assert len(bm.tables) >= 9
    for t in tables:
        assert list(bm.tables[t.row, : len(t.block_ids)]) == t.block_ids
    for t in tables:
        bm.free_table(t)
    assert bm.num_free_blocks == 32 and bm.leaked_blocks() == []
    assert sorted(bm.free_rows) == list(range(len(bm.tables)))
