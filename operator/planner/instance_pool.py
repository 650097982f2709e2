"""The prefill pool as the planner sees it: each instance's queueing time and node (Tetris §5.1).

``get_group`` is the instance-group extension (GetGroup in Algorithms 2 and 3): a group grows
from the previous chunks' instances, first inside their nodes, then onto the free node that
fits the rest with the shortest wait, so a ring stays inside as few nodes as it can. ``advance``
is the queue update of Eq. (2), ``commit`` books a chosen plan's chunks onto the pool.
"""

from __future__ import annotations

import collections
import itertools
import operator
from collections.abc import Iterable, Mapping, Sequence

_Entry = tuple[int, float, int]  # (node, queueing seconds T, instance id)
_TIME_ID = operator.itemgetter(1, 2)
_ID = operator.itemgetter(2)


class Pool:
    """Prefill instances by id: seconds until each is free (T_k), and the node each lives on.

    Treated as immutable: ``restrict``, ``advance`` and ``commit`` return new pools. Each node's
    instances are kept sorted by (T, id), shortest wait first, because every GetGroup choice reads
    them in that order; a queue update keeps the order (it is monotone), so it is not re-sorted.
    """

    __slots__ = ("_by_node", "_groups", "_ids", "_kth", "_largest", "_whole", "node_of", "queue")

    def __init__(
        self,
        queue: Mapping[int, float],
        node_of: Sequence[int],
        by_node: dict[int, list[_Entry]] | None = None,
    ) -> None:
        self.queue = queue
        self.node_of = node_of  # node of every instance id of the whole pool
        # The per-node view is built on first use: the C++ search (native.py) reads ``queue``
        # and ``node_of`` only, so a router that plans natively never pays for it.
        self._by_node = by_node
        self._largest = -1
        self._kth: dict[int, list[tuple[float, int]]] = {}
        self._whole: list[int] | None = None
        self._ids: dict[int, tuple[int, ...]] = {}
        self._groups: dict[tuple[tuple[int, ...], int], tuple[tuple[int, ...], float] | None] = {}

    @property
    def by_node(self) -> dict[int, list[_Entry]]:
        """Each node's instances as (node, T, id), sorted by (T, id)."""
        if self._by_node is None:
            # One sort of the whole pool by (node, T, id) in C, cut into runs per node: Python
            # touches nodes, not instances.
            queue, node_of = self.queue, self.node_of
            nodes = list(map(node_of.__getitem__, queue))
            entries = sorted(zip(nodes, queue.values(), queue, strict=True))
            by_node = {}
            start = 0
            for n, count in sorted(collections.Counter(nodes).items()):
                by_node[n] = entries[start : start + count]
                start += count
            self._by_node = by_node
        return self._by_node

    @property
    def largest(self) -> int:
        """Instances of the fullest node."""
        if self._largest < 0:
            self._largest = max(map(len, self.by_node.values()), default=0)
        return self._largest

    @staticmethod
    def uniform(queue: Sequence[float], per_node: int) -> Pool:
        """Instances 0..n-1 with these queueing times, ``per_node`` consecutive ids per node."""
        return Pool(dict(enumerate(queue)), tuple(i // per_node for i in range(len(queue))))

    def group(self, initial: tuple[int, ...], size: int) -> tuple[tuple[int, ...], float] | None:
        """``get_group`` and the group's wait, remembered: Algorithms 2 and 3 ask the same pool
        for the same extension several times in one search."""
        key = (initial, size)
        if key in self._groups:
            return self._groups[key]
        found = self._groups[key] = extend(self, initial, size)
        return found

    def wait(self, group: Iterable[int]) -> float:
        """A group's queueing time: a ring starts when its last member is free."""
        return max(map(self.queue.__getitem__, group))

    def restrict(self, group: tuple[int, ...]) -> Pool:
        """The pool of ``group``'s instances only (Algorithm 1 recurses inside instance_group)."""
        if len(group) == len(self.queue):
            return self
        keep = set(group)
        by_node = {}
        for n, entries in self.by_node.items():
            mine = [e for e in entries if e[2] in keep]
            if mine:
                by_node[n] = mine
        q = self.queue
        return Pool({i: q[i] for i in group}, self.node_of, by_node)

    def advance(self, elapsed: float) -> Pool:
        """Eq. (2): every instance's queue after ``elapsed`` seconds, T ← max(0, T − elapsed)."""
        if self._by_node is None:
            # Nothing has needed the per-node view (the C++ search, or the router between
            # plans): update the queue alone and leave the view to be built if asked for.
            later = {i: t - elapsed if t > elapsed else 0.0 for i, t in self.queue.items()}
            return Pool(later, self.node_of)
        by_node = {}
        queue: dict[int, float] = {}
        for n, entries in self.by_node.items():
            moved = [(n, t - elapsed if t > elapsed else 0.0, i) for _, t, i in entries]
            if moved[0][1] == 0.0:  # instances now free tie at 0: their order becomes by id
                free = sum(1 for e in moved if e[1] == 0.0)
                moved[:free] = sorted(moved[:free])
            by_node[n] = moved
            queue.update((i, t) for _, t, i in moved)
        return Pool(queue, self.node_of, by_node)

    def commit(self, busy_until: Iterable[tuple[Iterable[int], float]]) -> Pool:
        """Book chunks onto the pool: each (group, end) keeps its instances busy until ``end``."""
        q = dict(self.queue)
        for group, end in busy_until:
            for i in group:
                q[i] = max(q[i], end)
        return Pool(q, self.node_of)

    def ids(self, node: int) -> tuple[int, ...]:
        """A node's instance ids in this pool, shortest wait first."""
        ids = self._ids.get(node)
        if ids is None:
            ids = self._ids[node] = tuple(map(_ID, self.by_node[node]))
        return ids

    def kth_order(self, k: int) -> list[tuple[float, int]]:
        """Nodes with at least k instances as (k-th shortest T, node), ascending."""
        order = self._kth.get(k)
        if order is None:
            order = sorted((e[k - 1][1], n) for n, e in self.by_node.items() if len(e) >= k)
            self._kth[k] = order
        return order

    def whole_order(self) -> list[int]:
        """Nodes by when their slowest instance frees up (then larger first, then id)."""
        if self._whole is None:
            nodes = self.by_node
            self._whole = sorted(nodes, key=lambda n: (nodes[n][-1][1], -len(nodes[n]), n))
        return self._whole


def get_group(pool: Pool, initial: tuple[int, ...], size: int) -> tuple[int, ...] | None:
    """GetGroup (§5.1): extend ``initial`` to ``size`` instances of ``pool``, or None."""
    found = extend(pool, initial, size)
    return None if found is None else found[0]


def extend(pool: Pool, initial: tuple[int, ...], size: int) -> tuple[tuple[int, ...], float] | None:
    """GetGroup with the group's wait: first the shortest-queued instances of the nodes that
    ``initial`` uses, then (or for a first group) instances of free nodes by ``_fresh``."""
    need = size - len(initial)
    if need < 0:
        return None
    queue = pool.queue
    wait = max(map(queue.__getitem__, initial)) if initial else 0.0
    if need == 0:
        return initial, wait
    by_node = pool.by_node
    node_of = pool.node_of
    used = {node_of[i] for i in initial}
    parts = [initial]
    if used:
        mine = set(initial)
        extra = sorted(
            (e for n in used for e in by_node.get(n, ()) if e[2] not in mine), key=_TIME_ID
        )[:need]
        if extra:
            parts.append(tuple(map(_ID, extra)))
            wait = max(wait, extra[-1][1])
            need -= len(extra)
    if need:
        fresh = _fresh(pool, used, need)
        if fresh is None:
            return None
        parts += fresh[0]
        wait = max(wait, fresh[1])
    return tuple(itertools.chain.from_iterable(parts)), wait


def _fresh(pool: Pool, excluded: set[int], need: int) -> tuple[list[tuple[int, ...]], float] | None:
    """``need`` instances (as id runs) and their wait, from nodes outside ``excluded``: if one
    node can hold them, the node whose need-th shortest queue is shortest gives its ``need``
    shortest-queued instances; otherwise take the whole node that frees up first and repeat for
    the rest (§5.1 GetGroup case 1: whole nodes for what spans nodes, one node for the rest)."""
    by_node = pool.by_node
    picked: list[tuple[int, ...]] = []
    wait = 0.0
    taken = excluded
    wholes = pool.whole_order()  # whole nodes are taken in this order: one pass suffices
    pos = 0
    while True:
        if need <= pool.largest:
            for t, n in pool.kth_order(need):
                if n not in taken:
                    picked.append(pool.ids(n)[:need])
                    return picked, max(wait, t)
        while pos < len(wholes) and wholes[pos] in taken:
            pos += 1
        if pos == len(wholes):
            return None
        n = wholes[pos]
        if taken is excluded:
            taken = set(excluded)
        taken.add(n)
        picked.append(pool.ids(n))
        wait = max(wait, by_node[n][-1][1])
        need -= len(by_node[n])
