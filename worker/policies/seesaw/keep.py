"""Decoding sequences kept on the device through a prefill phase (Seesaw §4.2, Fig. 6).

At a switch to prefill the sequences still decoding keep their device blocks: the device KV is
block-major (rank_hook.DeviceKV), so the prefill gear, which only touches the blocks it is given,
never overwrites them, and they decode again in the next decode phase with no copy. They are
parked in the host store only when the prefill phase needs their blocks: when the next prompt
(arrival order) does not fit the free device blocks, the youngest are parked, only as many as
free enough blocks, and only if the prompt still fits the host pages once they are parked (else
parking would gain nothing and the phase ends instead). The leader's switch rule already made
sure that parking all of them costs the prefill phase no prompt (leader._parking_is_free).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from gearshift.worker.engine.sequence import Sequence


@dataclass(frozen=True)
class ParkPlan:
    """The kept sequences to park (youngest first), the host pages and device blocks they take
    and free, and whether that lets the next prompt in."""

    victims: tuple[Sequence, ...]
    pages: int
    freed: int
    enough: bool


@dataclass
class KeptSequences:
    """Sequences held on the device through a prefill phase, in admission order."""

    seqs: dict[str, Sequence] = field(default_factory=dict)
    kept: int = 0  # sequences kept at switches to prefill, so far
    parked: int = 0  # of them, parked to the host during a prefill phase

    def __contains__(self, rid: str) -> bool:
        return rid in self.seqs

    def __len__(self) -> int:
        return len(self.seqs)

    def keep(self, seqs: Seq[Sequence]) -> None:
        """The switch to prefill: ``seqs`` (decoding, in admission order) keep their blocks."""
        for seq in seqs:
            self.seqs[seq.request_id] = seq
        self.kept += len(seqs)

    def release_all(self) -> list[Sequence]:
        """The decode phase begins: every kept sequence decodes again."""
        out = list(self.seqs.values())
        self.seqs.clear()
        return out

    def forget(self, rid: str) -> None:
        """``rid`` is no longer kept (parked, finished or aborted)."""
        self.seqs.pop(rid, None)

    def plan_parking(
        self, need: int, free_blocks: int, free_pages: int, block_size: int, own_blocks: list[int]
    ) -> ParkPlan:
        """Youngest first, the fewest kept sequences whose blocks let a prompt of ``need`` blocks
        in beside ``free_blocks``; ``enough`` only if it then still fits ``free_pages`` less
        their pages. ``own_blocks[i]``: blocks the i-th kept sequence alone holds (it frees)."""
        victims: list[Sequence] = []
        pages = freed = 0
        for seq, own in zip(reversed(list(self.seqs.values())), reversed(own_blocks), strict=True):
            if free_blocks + freed >= need:
                break
            victims.append(seq)
            pages += -(-seq.num_computed_tokens // block_size)
            freed += own
        enough = free_blocks + freed >= need and free_pages - pages >= need
        return ParkPlan(tuple(victims), pages, freed, enough)
