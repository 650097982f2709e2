"""The WaS housekeeper (SiDP §4.2): slots filled in peak-shifted order ahead of compute, never
more than the slots, freed once used, and its thread gone after close. One process, no group."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from gearshift.worker.errors import GroupFailure
from gearshift.worker.policies.sidp import housekeeper as hk_module
from gearshift.worker.policies.sidp.housekeeper import Housekeeper
from gearshift.worker.policies.sidp.ownership import Ownership
from gearshift.worker.policies.sidp.shared_weights import FfnLayout

LAYOUT = FfnLayout(hidden=4, inter=8, bias=False)


def _housekeeper(
    dp: int, layers: int, rank: int, slots: int, depth: int, shift: bool, cls=Housekeeper
):
    own = Ownership(dp, layers)
    sources = {layer: torch.full((LAYOUT.numel,), float(layer)) for layer in own.remote(rank)}
    return cls(
        layout=LAYOUT,
        num_layers=layers,
        order=own.fetch_order(rank, shift),
        cycle_start={layer: c.start for c in own.cycles() for layer in c},
        sources=sources,
        slots=slots,
        prefetch_depth=depth,
        peak_shifting=shift,
    )


def _run_passes(hk: Housekeeper, own: Ownership, rank: int, passes: int) -> list[float]:
    seen = []
    for _ in range(passes):
        for layer in range(own.num_layers):
            hk.begin_layer(layer)
            if own.owner(layer) == rank:
                continue
            w = hk.acquire(layer)
            seen.append(float(w.gate_up[0, 0]))
            # Never more slots in use than there are.
            assert len(hk._ready) <= hk.slots
            hk.release(layer)
    return seen


@pytest.mark.parametrize(("dp", "rank", "shift"), [(2, 1, True), (4, 2, True), (4, 2, False)])
def test_compute_gets_every_remote_layer_in_order_from_slots(dp: int, rank: int, shift: bool):
    layers = 2 * dp + 1
    own = Ownership(dp, layers)
    hk = _housekeeper(dp, layers, rank, slots=dp - 1, depth=dp - 1, shift=shift).start()
    try:
        seen = _run_passes(hk, own, rank, passes=3)
    finally:
        hk.close()
    assert seen == [float(layer) for layer in own.remote(rank)] * 3
    # Every consumed layer was fetched once; the next pass may already be prefetched.
    assert 3 * len(own.remote(rank)) <= hk.stats.fetches <= 3 * len(own.remote(rank)) + dp - 1
    assert hk.stats.fetched_bytes == hk.stats.fetches * LAYOUT.numel * 4
    assert not hk.alive


def test_housekeeper_fetches_in_peak_shifted_order_and_stops_at_the_slots():
    hk = _housekeeper(4, 8, rank=1, slots=3, depth=3, shift=True)
    hk.start()
    try:
        deadline = time.monotonic() + 10
        while len(hk._ready) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        # Rank 1's first cycle in its shifted order (2, 3, 0), and nothing more: slots are full.
        assert sorted(layer for _, layer in hk._ready) == [0, 2, 3]
        assert hk.stats.fetches == 3
    finally:
        hk.close()
    assert not any(t.name == "sidp-housekeeper" and t.is_alive() for t in threading.enumerate())


def test_a_layer_that_never_arrives_fails_the_step_instead_of_hanging(monkeypatch):
    monkeypatch.setattr(hk_module, "SLOT_WAIT_S", 0.2)
    hk = _housekeeper(2, 2, rank=0, slots=1, depth=1, shift=True)  # thread never started
    hk.begin_layer(0)
    hk.begin_layer(1)
    with pytest.raises(GroupFailure, match="layer 1"):
        hk.acquire(1)
    assert hk.stats.slot_waits == 1
