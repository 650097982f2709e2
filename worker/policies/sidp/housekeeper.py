"""Weight-as-a-Service on one rank: cache slots and the housekeeper thread that fills them
(SiDP §4.2, asynchronous buffer management).

The housekeeper walks the remote layers of every forward pass in ``Ownership.fetch_order``
(peak-shifted) and copies each from its owner's shared memory into a free slot, at most
``prefetch_depth`` layers ahead of compute. Compute waits on the slot's own readiness, never on
a collective, and hands the slot back as soon as the layer's FFN has run.

On a GPU the slots live in device memory and the thread copies on its own CUDA stream (§4.2's
side stream), recording an event per copy: compute's stream waits on that event, not the host, and
a slot handed back records an event on compute's stream that the next copy into it waits on, so a
slot is never overwritten while a queued FFN still reads it.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from gearshift.worker.errors import GroupFailure
from gearshift.worker.policies.sidp.shared_weights import FfnLayout, FfnWeights

# Bounds every wait of compute on a slot: a housekeeper that cannot make progress is a bug or a
# dead owner, and must surface as an error, not a hang.
SLOT_WAIT_S = 60.0


@dataclass
class Slot:
    flat: torch.Tensor
    weights: FfnWeights
    key: tuple[int, int] | None = None  # (pass, layer) it holds or is being filled with
    copied: Any = None  # CUDA: recorded on the copy stream once the slot holds its layer
    used: Any = None  # CUDA: recorded on compute's stream once the layer's FFN is queued


@dataclass
class WasStats:
    fetched_bytes: int = 0
    fetches: int = 0
    slot_waits: int = 0  # compute found its layer not yet in a slot


@dataclass
class Housekeeper:
    """Slots and the prefetch thread of one rank (``start`` it; ``close`` it once)."""

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
        # The side stream the copies run on (GPU only); compute keeps its own stream.
        self.stream = torch.cuda.Stream(self.device) if self._cuda and self.slots else None
        self._slots = [self._new_slot() for _ in range(self.slots)]
        self._free = list(self._slots)
        self._ready: dict[tuple[int, int], Slot] = {}
        self._cond = threading.Condition()
        self._position = 0  # pass * num_layers + the layer compute is at
        self._pass = -1
        self._stopped = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def _new_slot(self) -> Slot:
        flat = torch.empty(self.layout.numel, dtype=self.dtype, device=self.device)
        slot = Slot(flat, self.layout.views(flat))
        if self._cuda:
            slot.copied, slot.used = torch.cuda.Event(), torch.cuda.Event()
        return slot

    @property
    def slot_bytes(self) -> int:
        return sum(s.flat.numel() * s.flat.element_size() for s in self._slots)

    def start(self) -> Housekeeper:
        if self.order:
            self._thread = threading.Thread(target=self._run, name="sidp-housekeeper", daemon=True)
            self._thread.start()
        return self

    # ---- compute side --------------------------------------------------------------------

    def begin_layer(self, layer: int) -> None:
        """Compute reached ``layer`` (layer 0 starts a new pass): the window moves on."""
        with self._cond:
            if layer == 0:
                self._pass += 1
            self._position = self._pass * self.num_layers + layer
            self._cond.notify_all()

    def acquire(self, layer: int) -> FfnWeights:
        """The slot holding ``layer`` for this pass, waiting (bounded) for its copy."""
        key = (self._pass, layer)
        with self._cond:
            if key not in self._ready:
                self.stats.slot_waits += 1
                ok = self._cond.wait_for(
                    lambda: key in self._ready or self._error is not None or self._stopped,
                    timeout=SLOT_WAIT_S,
                )
                if self._error is not None:
                    raise GroupFailure(f"SiDP housekeeper failed: {self._error}")
                if not ok or key not in self._ready:
                    raise GroupFailure(f"SiDP: layer {layer}'s weights never reached a slot")
            slot = self._ready[key]
        if slot.copied is not None:
            # The GPU waits for the copy; the host goes on queueing work (§4.2).
            torch.cuda.current_stream(self.device).wait_event(slot.copied)
        return slot.weights

    def release(self, layer: int) -> None:
        """The layer's FFN ran: its slot is free for the next fetch (§4.2)."""
        with self._cond:
            slot = self._ready.pop((self._pass, layer))
            if slot.used is not None:
                slot.used.record(torch.cuda.current_stream(self.device))
            slot.key = None
            self._free.append(slot)
            self._cond.notify_all()

    # ---- the thread ----------------------------------------------------------------------

    def _allowed(self, key: tuple[int, int]) -> bool:
        n, layer = key
        # Peak shifting fetches a whole cycle out of layer order, so the window opens per cycle
        # (dp - 1 slots hold it); in layer order it opens per layer.
        anchor = self.cycle_start[layer] if self.peak_shifting else layer
        return n * self.num_layers + anchor - self._position <= self.prefetch_depth

    def _can_fetch(self, key: tuple[int, int]) -> bool:
        return self._stopped or (bool(self._free) and self._allowed(key))

    def _copy(self, slot: Slot, src: torch.Tensor) -> None:
        if self.stream is None:
            slot.flat.copy_(src)
            return
        with torch.cuda.stream(self.stream):
            # Not before the FFN that last read this slot has run on compute's stream.
            self.stream.wait_event(slot.used)
            slot.flat.copy_(src, non_blocking=True)
            slot.copied.record(self.stream)

    def _run(self) -> None:
        try:
            if self._cuda:
                torch.cuda.set_device(self.device)  # the current device is per thread
            n = 0
            while True:
                for layer in self.order:
                    key = (n, layer)
                    with self._cond:
                        self._cond.wait_for(functools.partial(self._can_fetch, key))
                        if self._stopped:
                            return
                        slot = self._free.pop()
                        slot.key = key
                    src = self.sources[layer]
                    self._copy(slot, src)
                    with self._cond:
                        self.stats.fetches += 1
                        self.stats.fetched_bytes += src.numel() * src.element_size()
                        self._ready[key] = slot
                        self._cond.notify_all()
                n += 1
        except BaseException as exc:  # noqa: BLE001 - reported to compute by acquire
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def reset(self) -> None:
        """Drop every prefetched slot and restart the window at pass 0 (a mode switch back to
        WaS: the passes in between did not consume slots)."""
        self.close()
        self._free = list(self._slots)
        self._ready.clear()
        self._position, self._pass = 0, -1
        self._stopped = False
        self.start()

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=SLOT_WAIT_S)
            self._thread = None
        if self.stream is not None:
            self.stream.synchronize()  # no copy still writes a slot

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
