"""Issue 29's comparisons projected by the simulator on the papers' hardware
(``benchmarks/projections.py``), each pinned within the band its ``Projection`` states, and the
comparison's direction asserted where the paper claims one."""

from __future__ import annotations

import pytest

from gearshift.operator.sim.reproduce import seesaw, sidp, tetris
from gearshift.operator.sim.reproduce.common import Projection, priced
from gearshift.operator.sim.tetris_rates import PoolShape, mean_ttft, planned_ttfts


def _check(r: Projection) -> None:
    assert r.band[0] <= r.simulated <= r.band[1], f"{r.paper} {r.pricing}: {r.simulated}"
    assert r.note and r.paper_figure and r.figures


def test_scaled_pricing_slows_the_preset_and_keeps_its_memory() -> None:
    hw = sidp.paper_hardware("H20")
    scaled = priced(hw, "scaled")
    assert scaled.device.memory_bandwidth < hw.device.memory_bandwidth
    assert scaled.device.flops["bf16"] < hw.device.flops["bf16"]
    assert scaled.device.memory_bytes == hw.device.memory_bytes
    assert priced(hw, "datasheet") is hw
    with pytest.raises(ValueError, match="pricing"):
        priced(hw, "fitted")


def test_planned_ttfts_are_what_mean_ttft_averages() -> None:
    lengths = tetris.tetris("short")
    each = planned_ttfts(tetris.RULES, PoolShape(16, 8), lengths, 1.0, 0.3, 50)
    assert len(each) == 50
    assert sum(each) / 50 == mean_ttft(tetris.RULES, PoolShape(16, 8), lengths, 1.0, 0.3, 50)


@pytest.mark.slow
def test_sidp_projection_on_h20() -> None:
    """The scaled H20, AUTO against plain DP (the datasheet pricing, 1.30x, and WaS and CaS held
    are in benchmarks/projections.json; the suite runs the two simulations the claim rests on)."""
    r = sidp.project("H20", "scaled", modes=False)
    _check(r)
    f = r.figures
    # Fig. 5: more KV at TP 2 x DP 4 (the same formula as the reproduction, ~1.7x).
    assert 1.5 <= f["kv_ratio"] <= 1.9
    # The batch is 1.5 times what plain DP holds: its KV binds (it preempts growing sequences),
    # SiDP's does not; that capacity is what turns into tokens/s (§5.2).
    assert f["SiDP AUTO"]["kv_tokens"] > f["plain DP"]["kv_tokens"]
    assert f["plain DP"]["preemptions"] > 0 and f["SiDP AUTO"]["preemptions"] == 0
    # The paper's direction: SiDP beats DP+TP at S = 4K.
    assert r.simulated > 1.0


def _pressure(r: Projection) -> dict[str, object]:
    best: dict[str, object] = r.figures["candidates"][r.figures["best_seesaw"]]
    # The store filled: the leader switched at least as often as the capacities force, and no
    # prompt was recomputed for lack of room (the leader admits by free host pages).
    assert best["transitions"] >= best["min_transitions"] >= 3  # type: ignore[operator]
    assert best["preemptions"] == 0 and best["rejected"] == 0
    return best


@pytest.mark.slow
def test_seesaw_projection_prefill_heavy_on_l4() -> None:
    r = seesaw.project_pressure("L4", "prefill-heavy", "scaled")
    _check(r)
    _pressure(r)
    # The paper's direction (§6.2): Seesaw at least the best static layout on prefill-heavy.
    assert r.simulated >= 1.0


@pytest.mark.slow
def test_seesaw_projection_balanced_on_l4_disagrees_slightly() -> None:
    """Scaled L4, balanced (ShareGPT) lengths: the simulator has Seesaw 3% behind TP 8 (0.974x),
    against the paper's gain; benchmarks/README.md says so. On the datasheet it is 1.38x."""
    r = seesaw.project_pressure("L4", "balanced", "scaled")
    _check(r)
    _pressure(r)
    assert 0.9 <= r.simulated <= 1.1


@pytest.mark.parametrize("pricing", ["table1", "scaled"])
def test_tetris_projection_ttft_at_the_critical_rate(pricing: str) -> None:
    r = tetris.project_ttft(pricing, 1.0)
    _check(r)
    rows = r.figures["strategies"]
    assert set(rows) == {f"fixed SP {k}" for k in tetris.FIXED_SIZES} | {"CDSP", "single-chunk"}
    # The paper's direction at the best baseline's critical rate (Fig. 9): CDSP no slower at p50
    # than any fixed SP. (With 300 arrivals instead of 1000 the scaled pool gives 0.95: at
    # saturation the p50 moves with the trace's length.)
    assert r.simulated >= 1.0
    # Fig. 13: single-chunk plans no faster at p50 (a restriction of CDSP's search; the
    # trajectories differ, so only within 1%).
    assert r.figures["single_chunk_p50_over_cdsp"] >= 0.99


def test_tetris_projection_at_half_load_disagrees_slightly() -> None:
    """At half the critical rate with Table 1's models the simulator has CDSP's p50 about 4%
    behind fixed SP 8 (1.21 s vs 1.16 s): the paper's direction does not hold there, and
    benchmarks/README.md says so. Pinned so that a change shows."""
    r = tetris.project_ttft("table1", 0.5)
    _check(r)
    assert r.figures["strategies"]["fixed SP 8"]["p50_s"] == min(
        v["p50_s"] for k, v in r.figures["strategies"].items() if k.startswith("fixed")
    )
    assert 0.9 <= r.simulated <= 1.1


def test_tetris_datasheet_fit_error_is_reported() -> None:
    """On the datasheet A100 the SP 16 ring crosses the 25 GB/s inter-node link and Eq. (1)
    fits the roofline's max(compute, ring) badly; the projection says so in its note."""
    rules = tetris.pool_rules("datasheet")
    errors = tetris._fit_errors(rules, "datasheet")
    assert errors[16] > 1.0 and errors[1] < 0.05
