"""The leader's bookkeeping of the host KV tier's pages (Seesaw §4.2): a free list and the pages
each sequence holds. Torch-free: the simulator (operator/sim/seesaw_sim.py) runs it too."""

from __future__ import annotations


class PageAllocator:
    """The leader's bookkeeping of host pages: a free list and the pages each sequence holds."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.free = list(range(num_pages - 1, -1, -1))
        self.held: dict[str, list[int]] = {}

    @property
    def used(self) -> int:
        return self.num_pages - len(self.free)

    @property
    def usage(self) -> float:
        return self.used / self.num_pages if self.num_pages else 1.0

    def allocate(self, request_id: str, count: int) -> list[int] | None:
        if count > len(self.free) or request_id in self.held:
            return None
        pages = [self.free.pop() for _ in range(count)]
        self.held[request_id] = pages
        return pages

    def release(self, request_id: str) -> int:
        return self.give_back(self.detach(request_id))

    def detach(self, request_id: str) -> list[int]:
        """The pages ``request_id`` holds, no longer under its name (still not free)."""
        return self.held.pop(request_id, [])

    def give_back(self, pages: list[int]) -> int:
        self.free.extend(reversed(pages))
        return len(pages)
