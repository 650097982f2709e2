"""Leader-side bookkeeping of KV blocks: allocation, freeing, and automatic prefix caching.

Full blocks are content-addressed by a hash chained over the tokens of every block before them, so
a block is reusable exactly when the whole prefix up to its end matches. Blocks whose last user
left stay cached in an LRU free queue until their slot is needed again.

The chain is a keyed 128-bit BLAKE2b (a random key per block manager): nobody outside can compute
a block's hash, so no crafted prompt can collide with (and alias) another's cached block, which
Python's deterministic tuple hash of token ids allowed. A request's cache_salt (vLLM's) goes into
the hash of its first block: requests with different salts never share a block, and their
cached_prompt_tokens reveal nothing about each other's prompts.

A block's KV is only valid in the layout that wrote it. A policy whose ranks view the cache in
more than one layout (Seesaw's gears) sets ``view`` to the layout its next steps write: every
block hash includes it, so a lookup hits only blocks written in the current view, and a cached
block of another view keeps its entry (no reset) until its slot is handed out again.

Block tables live in one persistent int64 array, a row per running sequence, so building a step's
block-table tensor is a single numpy fancy-index instead of a Python loop over sequences.
"""

from __future__ import annotations

import hashlib
import secrets
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

_ROOT_HASH = 0  # the parent of an unsalted first block
_SALT_ROOT = 1  # the parent of a salt's own hash (never a block's: those are 128-bit digests)
_HASH_BYTES = 16


@dataclass
class BlockTable:
    """The blocks one sequence holds, in token order; ``hashes`` covers its cached full blocks."""

    block_ids: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    row: int = -1


@dataclass(frozen=True)
class PrefixHit:
    """Cached full blocks matching the start of a prompt."""

    block_ids: tuple[int, ...] = ()
    hashes: tuple[int, ...] = ()


class BlockManager:
    """Owns the free list, reference counts, the prefix cache and the block-table rows."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_seqs: int,
        max_blocks_per_seq: int,
        enable_prefix_caching: bool = True,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV cache has no room for a single block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # Insertion order is eviction order: the first key is evicted first.
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # chained hash → block id
        self.tables = np.zeros((max_seqs, max_blocks_per_seq), dtype=np.int64)
        self.free_rows = list(range(max_seqs - 1, -1, -1))
        self.prefix_queries = 0
        self.prefix_hit_tokens = 0
        self._hash_key = secrets.token_bytes(_HASH_BYTES)
        # The KV layout blocks are written in from now on (0: the only one most policies have).
        self.view = 0

    def _digest(self, parent: int, payload: bytes) -> int:
        data = parent.to_bytes(_HASH_BYTES, "little") + payload
        digest = hashlib.blake2b(data, key=self._hash_key, digest_size=_HASH_BYTES).digest()
        return int.from_bytes(digest, "little")

    def block_hash_of(self, parent: int, tokens: Sequence[int]) -> int:
        """The chained hash of a full block of `tokens` after the block hashed `parent`, in the
        current ``view`` (its 8 extra bytes make the payload's length differ from view 0's)."""
        payload = array("q", tokens).tobytes()
        if self.view:
            payload = self.view.to_bytes(8, "little") + payload
        return self._digest(parent, payload)

    def root(self, salt: str = "") -> int:
        """The parent hash of a sequence's first block: salted requests start their own chain."""
        return self._digest(_SALT_ROOT, salt.encode()) if salt else _ROOT_HASH

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running sequences (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, token_ids: Sequence[int], max_tokens: int, salt: str = "") -> PrefixHit:
        """Longest run of cached full blocks covering at most ``max_tokens`` leading tokens,
        among those cached under the same ``salt``."""
        if not self.enable_prefix_caching:
            return PrefixHit()
        bs = self.block_size
        blocks: list[int] = []
        hashes: list[int] = []
        parent = self.root(salt)
        for start in range(0, max_tokens - bs + 1, bs):
            h = self.block_hash_of(parent, token_ids[start : start + bs])
            block = self.cached.get(h)
            if block is None:
                break
            blocks.append(block)
            hashes.append(h)
            parent = h
        self.prefix_queries += 1
        self.prefix_hit_tokens += len(blocks) * bs
        return PrefixHit(tuple(blocks), tuple(hashes))

    def allocate(self, table: BlockTable, num_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Grow ``table`` to hold ``num_tokens`` tokens, first reusing ``hit``; all or nothing."""
        if not hit and num_tokens <= len(table.block_ids) * self.block_size:
            return True  # the common decode step: the last block still has room
        prefix = hit.block_ids if hit else ()
        need = self.blocks_needed(num_tokens) - len(table.block_ids) - len(prefix)
        reclaimed = sum(1 for b in prefix if self.ref_counts[b] == 0)
        if need > len(self.free) - reclaimed:
            return False
        if table.row < 0:
            table.row = self._take_row()
        row = self.tables[table.row]
        if hit:
            for b in hit.block_ids:
                if self.ref_counts[b] == 0:
                    del self.free[b]
                self.ref_counts[b] += 1
                row[len(table.block_ids)] = b
                table.block_ids.append(b)
            table.hashes.extend(hit.hashes)
        for _ in range(max(need, 0)):
            b, _ = self.free.popitem(last=False)
            self._take(table, b)
        return True

    def allocate_where(
        self, table: BlockTable, num_tokens: int, accept: Callable[[int], bool]
    ) -> bool:
        """Grow ``table`` to hold ``num_tokens`` tokens with free blocks that ``accept`` (in
        free-list order); all or nothing. For a caller whose blocks must avoid some memory."""
        need = self.blocks_needed(num_tokens) - len(table.block_ids)
        if need <= 0:
            return True
        chosen: list[int] = []
        for b in self.free:
            if accept(b):
                chosen.append(b)
                if len(chosen) == need:
                    break
        if len(chosen) < need:
            return False
        if table.row < 0:
            table.row = self._take_row()
        for b in chosen:
            del self.free[b]
            self._take(table, b)
        return True

    def _take_row(self) -> int:
        """A free block-table row. The table starts with one row per seat (max_num_seqs), but
        a sequence holds its row for as long as it holds KV, not only while it has a seat: a
        Tetris decode instance reserves blocks for every request whose KV is on its way
        (``policies/tetris/admission.py``), however many are running. So when every row is
        held the table doubles, rather than fail the holder; the rows are gathered per step
        (``engine/plan.py``), so nothing keeps the old array."""
        if not self.free_rows:
            n = len(self.tables)
            self.tables = np.concatenate([self.tables, np.zeros_like(self.tables)])
            self.free_rows = list(range(2 * n - 1, n - 1, -1))
        return self.free_rows.pop()

    def _take(self, table: BlockTable, b: int) -> None:
        """Give free block ``b`` (already off the free list) to ``table``."""
        old = self.block_hash[b]
        if old is not None:
            # Evict the cached content this slot held.
            if self.cached.get(old) == b:
                del self.cached[old]
            self.block_hash[b] = None
        self.ref_counts[b] = 1
        self.tables[table.row][len(table.block_ids)] = b
        table.block_ids.append(b)

    def cache_full_blocks(
        self, table: BlockTable, token_ids: Sequence[int], num_computed: int, salt: str = ""
    ) -> None:
        """Register blocks whose every token now has KV computed (under the sequence's salt)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(num_computed // bs, len(table.block_ids))
        parent = table.hashes[-1] if table.hashes else self.root(salt)
        for i in range(len(table.hashes), full):
            h = self.block_hash_of(parent, token_ids[i * bs : (i + 1) * bs])
            table.hashes.append(h)
            block = table.block_ids[i]
            if h not in self.cached and self.block_hash[block] is None:
                self.cached[h] = block
                self.block_hash[block] = h
            parent = h

    def free_table(self, table: BlockTable) -> None:
        """Release every block of ``table`` and its row; cached blocks stay reusable."""
        for b in reversed(table.block_ids):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free[b] = None
                if self.block_hash[b] is None:
                    # Uncached blocks hold nothing reusable: hand them out first.
                    self.free.move_to_end(b, last=False)
        table.block_ids.clear()
        table.hashes.clear()
        if table.row >= 0:
            self.free_rows.append(table.row)
            table.row = -1

    def retain(self, block_ids: Sequence[int]) -> None:
        """One more reference to blocks a table holds, dropped by ``release``: they stay
        allocated even if their table is freed meanwhile (e.g. a copy still writes into them)."""
        for b in block_ids:
            if self.ref_counts[b] == 0:
                raise ValueError(f"block {b} is free: only a held block can be retained")
            self.ref_counts[b] += 1

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop the references ``retain`` took."""
        self.free_table(BlockTable(list(block_ids)))

    def leaked_blocks(self) -> list[int]:
        """Blocks still referenced; empty once every sequence has been freed."""
        return [b for b, n in enumerate(self.ref_counts) if n]

    def reset_prefix_cache(self) -> None:
        """Forget every cached block nobody holds; they become plain free blocks."""
        for h, b in list(self.cached.items()):
            if self.ref_counts[b] == 0:
                del self.cached[h]
                self.block_hash[b] = None
                # Like any uncached free block: handed out first (its pages are already warm).
                self.free.move_to_end(b, last=False)
