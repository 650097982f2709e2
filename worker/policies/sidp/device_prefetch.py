"""Weight-as-a-Service on a GPU with every wait on the device (SiDP §4.2), so a decode step can
be captured as a CUDA graph.

The housekeeper thread (housekeeper.py) makes compute wait on the host until a layer's copy has
been queued; a captured graph runs no host code, and a thread's event records race a replayed
graph. Here compute's own thread queues the copies, each on the side stream (the housekeeper's
stream): the side stream waits on the slot's ``used`` event (recorded on compute's stream once
the slot's last FFN was queued), copies the layer from its owner's memory (CUDA IPC), records
``copied``; compute's stream waits on ``copied`` before the FFN. Nothing blocks the host.

What a pass queues is the same every pass: copies go into slots in a fixed order (a FIFO free
list), only for the current pass (the window does not reach into the next one, so every copy a
step forks off is joined back in the same step, as graph capture requires), the free slots in
the same order at every pass's start, at most
``prefetch_depth`` layers (peak shifting: cycles) ahead of compute. A captured pass therefore
replays exactly what the next pass would queue.

On CPU the same schedule runs with synchronous copies (tests: GEARSHIFT_SIDP_DEVICE_PREFETCH).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from gearshift.worker.errors import GroupFailure
from gearshift.worker.policies.sidp.housekeeper import Housekeeper, Slot
from gearshift.worker.policies.sidp.shared_weights import FfnWeights

DEVICE_PREFETCH_ENV = "GEARSHIFT_SIDP_DEVICE_PREFETCH"  # "1": this prefetcher on CPU too


@dataclass
class DevicePrefetch(Housekeeper):
    """The housekeeper's slots (and its side stream), filled from compute's thread instead."""

    def __post_init__(self) -> None:
        super().__post_init__()  # slots, events, the side stream; no thread is ever started
        self._free_queue: deque[Slot] = deque(self._slots)
        self._filled: dict[int, Slot] = {}  # remote layer -> its slot, this pass
        self._next = 0  # index in ``order`` of the next layer to queue this pass
        self._at = 0  # the layer compute is at
        self.log: list[tuple[int, int]] = []  # (layer, slot index) of every copy queued

    def start(self) -> DevicePrefetch:
        return self  # nothing runs beside compute

    # ---- compute side (the only side) ----------------------------------------------------

    def begin_layer(self, layer: int) -> None:
        """Compute reached ``layer`` (0: a new pass, whose copies start now)."""
        if layer == 0:
            if self._filled:
                raise GroupFailure(f"SiDP: layers {sorted(self._filled)} fetched, never used")
            # Every slot is free between passes: in the same order each time, so each pass
            # queues its copies into the same slots (the used events keep them ordered).
            self._free_queue = deque(self._slots)
            self._next = 0
        self._at = layer
        self._queue(until=None)

    def acquire(self, layer: int) -> FfnWeights:
        """``layer``'s slot; compute's stream (not the host) waits for its copy."""
        slot = self._filled.get(layer)
        if slot is None:  # outside the window so far: queue it (and what precedes it) now
            self.stats.slot_waits += 1
            self._queue(until=layer)
            slot = self._filled.get(layer)
            if slot is None:
                raise GroupFailure(
                    f"SiDP: no free slot for layer {layer} ({self.slots} slots, fetch order "
                    f"{self.order})"
                )
        if slot.copied is not None:
            torch.cuda.current_stream(self.device).wait_event(slot.copied)
        return slot.weights

    def release(self, layer: int) -> None:
        """The layer's FFN is queued: its slot takes the next copy once that FFN has run."""
        slot = self._filled.pop(layer)
        if slot.used is not None:
            slot.used.record(torch.cuda.current_stream(self.device))
        slot.key = None
        self._free_queue.append(slot)
        self._queue(until=None)

    def _in_window(self, layer: int) -> bool:
        anchor = self.cycle_start[layer] if self.peak_shifting else layer
        return anchor - self._at <= self.prefetch_depth

    def _queue(self, until: int | None) -> None:
        """Queue copies in fetch order while a slot is free: within the window, or (``until``)
        up to that layer whatever the window says."""
        while self._next < len(self.order) and self._free_queue:
            layer = self.order[self._next]
            if until is None and not self._in_window(layer):
                return
            self._fetch(layer)
            self._next += 1
            if layer == until:
                return

    def _fetch(self, layer: int) -> None:
        slot = self._free_queue.popleft()
        src = self.sources[layer]
        if self.stream is None:
            slot.flat.copy_(src)
        else:
            with torch.cuda.stream(self.stream):
                # Not before the FFN that last read this slot has run on compute's stream.
                self.stream.wait_event(slot.used)
                slot.flat.copy_(src, non_blocking=True)
                slot.copied.record(self.stream)
        slot.key = (0, layer)
        self._filled[layer] = slot
        self.log.append((layer, next(i for i, s in enumerate(self._slots) if s is slot)))
        self.stats.fetches += 1
        self.stats.fetched_bytes += src.numel() * src.element_size()

    def reset(self) -> None:
        """Back to WaS after CaS steps: every slot free, a new pass next."""
        self.close()
        self._free_queue = deque(self._slots)
        self._filled.clear()
        self._next, self._at = 0, 0
