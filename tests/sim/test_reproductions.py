"""The four papers' headlines reproduced by the simulator from their published inputs, each
pinned within the band docs/planning.md states (issue 16, "Fidelity against the papers")."""

from __future__ import annotations

import pytest

from gearshift.operator.sim.reproduce import seesaw, shift, sidp, tetris
from gearshift.operator.sim.reproduce.common import Reproduction


def _check(r: Reproduction) -> None:
    assert r.simulated is not None, r.note
    assert r.band[0] <= r.simulated <= r.band[1], f"{r.paper}: {r.simulated} not in {r.band}"
    assert r.note and r.paper_figure


def test_shift_beats_tp_on_response_and_on_throughput() -> None:
    response, throughput = shift.reproduce(requests=100)
    _check(response)
    _check(throughput)
    assert response.simulated > 1 and throughput.simulated > 1  # type: ignore[operator]


def test_sidp_kv_capacity_at_tp2_dp4() -> None:
    r = sidp.reproduce()
    _check(r)
    # Fig. 5 is on H20, and the paper's H20 has 144 GB (Table 1): the GPU and its memory are named.
    assert "H20" in r.note and "144 GB" in r.note


@pytest.mark.slow
def test_seesaw_beats_the_best_static_layout_on_pcie() -> None:
    r = seesaw.reproduce()
    _check(r)
    assert "the engine's Seesaw leader" in r.note
    per = seesaw.speedups()  # the phase-by-phase cross-check
    assert all(v["speedup"] >= 0.99 for v in per.values())  # type: ignore[operator]
    # PP prefill, TP decode: the gear pair the paper reports for PCIe GPUs (Fig. 10 labels).
    assert all(str(v["seesaw_gears"]).startswith("P1x8->D8x1") for v in per.values())


@pytest.mark.slow
def test_tetris_raises_the_max_load_over_fixed_sp8() -> None:
    r = tetris.reproduce()
    _check(r)
    gains = tetris.gains()
    assert all(v["gain"] > 1.0 for v in gains.values())
    # Longer prompts leave less room to adapt: the gain shrinks from Short to Long (§7.2).
    assert gains["short"]["gain"] >= gains["medium"]["gain"] >= gains["long"]["gain"]


def test_max_load_is_the_highest_rate_within_the_bound() -> None:
    def ttft(rate: float) -> float:
        return 2.0 * rate

    assert tetris.max_load(ttft, bound=10.0) == pytest.approx(5.0, rel=0.02)
