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
from dataclasses import dataclass, field

import torch

from gearshift.worker.errors import GroupFailure
from gearshift.worker.policies.sidp.housekeeper import Slot, WasStats
from gearshift.worker.policies.sidp.shared_weights import FfnLayout, FfnWeights

DEVICE_PREFETCH_ENV = "GEARSHIFT_SIDP_DEVICE_PREFETCH"  # "1": this prefetcher on CPU too


@dataclass
class DevicePrefetch:
    """Slots and the side stream of one rank; the same interface as ``Housekeeper``."""

    layout: FfnLayout
    num_layers: int
    order: list[int]  # remote layers of one pass, in fetch order
    cycle_start: dict[int, int]  # layer -> first layer of its cycle
    sources: dict[int, torch.Tensor]  # remote layer -> its owner's flat segment tensor
    slots: int
    prefetch_depth: int
    peak_shifting: bool
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    stats: WasStats = field(default_factory=WasStats)

    def __post_init__(self) -> None:
        self._cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self._cuda and self.slots else None
        self._slots = [self._new_slot() for _ in range(self.slots)]
        self._free: deque[Slot] = deque(self._slots)
        self._ready: dict[int, Slot] = {}  # remote layer -> its slot, this pass
        self._next = 0  # index in ``order`` of the next layer to queue this pass
        self._position = 0  # the layer compute is at
        self.log: list[tuple[int, int]] = []  # (layer, slot index) of every copy queued

    def _new_slot(self) -> Slot:
        flat = torch.empty(self.layout.numel, dtype=self.dtype, device=self.device)
        slot = Slot(flat, self.layout.views(flat))
        if self._cuda:
            slot.copied, slot.used = torch.cuda.Event(), torch.cuda.Event()
        return slot

    @property
    def slot_bytes(self) -> int:
        return sum(s.flat.numel() * s.flat.element_size() for s in self._slots)

    @property
    def alive(self) -> bool:
        return False  # no thread

    def start(self) -> DevicePrefetch:
        return self

    # ---- compute side (the only side) ----------------------------------------------------

    def begin_layer(self, layer: int) -> None:
        """Compute reached ``layer`` (0: a new pass, whose copies start now)."""
        if layer == 0:
            if self._ready:
                raise GroupFailure(f"SiDP: layers {sorted(self._ready)} fetched, never used")
            # Every slot is free between passes: in the same order each time, so each pass
            # queues its copies into the same slots (the used events keep them ordered).
            self._free = deque(self._slots)
            self._next = 0
        self._position = layer
        self._queue(until=None)

    def acquire(self, layer: int) -> FfnWeights:
        """``layer``'s slot; compute's stream (not the host) waits for its copy."""
        slot = self._ready.get(layer)
        if slot is None:  # outside the window so far: queue it (and what precedes it) now
            self.stats.slot_waits += 1
            self._queue(until=layer)
            slot = self._ready.get(layer)
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
        slot = self._ready.pop(layer)
        if slot.used is not None:
            slot.used.record(torch.cuda.current_stream(self.device))
        slot.key = None
        self._free.append(slot)
        self._queue(until=None)

    def _allowed(self, layer: int) -> bool:
        anchor = self.cycle_start[layer] if self.peak_shifting else layer
        return anchor - self._position <= self.prefetch_depth

    def _queue(self, until: int | None) -> None:
        """Queue copies in fetch order while a slot is free: within the window, or (``until``)
        up to that layer whatever the window says."""
        while self._next < len(self.order) and self._free:
            layer = self.order[self._next]
            if until is None and not self._allowed(layer):
                return
            self._fetch(layer)
            self._next += 1
            if layer == until:
                return

    def _fetch(self, layer: int) -> None:
        slot = self._free.popleft()
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
        self._ready[layer] = slot
        self.log.append((layer, next(i for i, s in enumerate(self._slots) if s is slot)))
        self.stats.fetches += 1
        self.stats.fetched_bytes += src.numel() * src.element_size()

    def reset(self) -> None:
        """Back to WaS after CaS steps: every slot free, a new pass next."""
        self.close()
        self._free = deque(self._slots)
        self._ready.clear()
        self._next, self._position = 0, 0

    def close(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()  # no copy still writes a slot
