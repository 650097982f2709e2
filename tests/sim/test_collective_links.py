"""Links fitted to a profile's measured collectives (issue 30, item 1; sim/links.py), where the
simulator uses them (``Hardware.link_for``), and `plan --profile --unprofiled roofline` with them:
slower measured collectives change the figures of the roofline-priced layouts that use them, and
not those of one-rank layouts or of layouts priced from their measured steps."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gearshift.operator.sim import calibration, links, model_desc, pricing
from gearshift.operator.sim.calibration import Collective
from gearshift.operator.sim.hardware import GB, US, Link, preset
from gearshift.operator.sim.roofline import all_reduce, all_to_all, p2p

GEARSHIFT = [sys.executable, "-m", "gearshift.operator.cli"]
LLAMA = Path(__file__).parent / "fixtures" / "llama3_8b_config.json"
SIZES = (4096, 65536, 1 << 20, 16 << 20)


def _priced(collective: str, nbytes: float, ranks: int, link: Link) -> float:
    """What the simulator charges for one collective (roofline.py's functions)."""
    if collective == "all_reduce":
        return all_reduce(nbytes, ranks, link)
    if collective in ("all_to_all", "all_gather"):
        return all_to_all(nbytes, ranks, link)
    return p2p(nbytes, link)


@pytest.mark.parametrize("collective", ["all_reduce", "all_to_all", "all_gather", "send_recv"])
def test_the_fit_gives_back_the_link_the_simulator_would_price_the_points_with(
    collective: str,
) -> None:
    truth = Link(bandwidth=40 * GB, latency=7 * US)
    points = [[float(b), _priced(collective, b, 4, truth)] for b in SIZES]
    fitted = links.fit(collective, Collective(4, points))
    assert fitted is not None
    link, err = fitted
    assert link.latency == pytest.approx(truth.latency, rel=1e-6)
    assert link.bandwidth == pytest.approx(truth.bandwidth, rel=1e-6)
    assert err < 1e-9


def test_times_that_do_not_grow_with_size_give_no_link() -> None:
    flat = Collective(2, [[4096.0, 2e-3], [16e6, 1e-3]])
    assert links.fit("all_reduce", flat) is None


def test_a_negative_intercept_is_refitted_through_zero() -> None:
    # 2 ms at 1 MB and 20 ms at 16 MB, 0.1 ms at 4 KiB: a line through the two large ones would
    # cross below zero at the small one; α then is 0, not negative.
    points = [[4096.0, 1e-4], [1e6, 2e-3], [16e6, 2e-2]]
    fitted = links.fit("send_recv", Collective(2, points))
    assert fitted is not None and fitted[0].latency >= 0 and fitted[0].bandwidth > 0


def test_a_measured_link_replaces_the_preset_only_over_the_same_link_class() -> None:
    hw = preset("16xH100")
    mine = Link(bandwidth=1 * GB, latency=1e-3)
    measured = type(hw)(**{**hw.__dict__, "measured": (("all_reduce", 2, mine),)})
    assert measured.link_for("all_reduce", 8) == mine  # NVLink, as the pair it was measured on
    assert measured.link_for("all_reduce", 16) == hw.inter_node  # crosses the network: preset
    assert measured.link_for("all_to_all", 2) == hw.intra_node  # not measured: preset
    assert hw.link_for("all_reduce", 8) == hw.intra_node  # no profile: the preset's


def _fit() -> dict[str, float]:
    return {"a": 0.002, "b": 2e-6, "c": 1e-9}


def _profile(slow: float) -> dict[str, Any]:
    """An H200 profile of tp2, sp2 and pp2 whose collectives took ``slow`` times an NVLink's."""
    nvlink = Link(bandwidth=450 * GB, latency=3 * US)

    def points(name: str) -> dict[str, Any]:
        return {
            "ranks": 2,
            "points": [[float(b), slow * _priced(name, b, 2, nvlink)] for b in SIZES],
        }

    def layout(policy: dict[str, Any], used: tuple[str, ...]) -> dict[str, Any]:
        return {
            "policy": policy,
            "kv_blocks": 4096,
            "block_size": 16,
            "step_cost": {
                "format": "gearshift.step-cost/1",
                "prefill": _fit(),
                "decode": _fit(),
                "about": dict.fromkeys(calibration.GRID_KEYS, 1e9),
            },
            "collectives": {n: points(n) for n in used},
        }

    return {
        "format": calibration.FORMAT,
        "device": "NVIDIA H200",
        "device_kind": "cuda",
        "devices": 2,
        "engine_version": "0.1.0",
        "dtype": "bfloat16",
        "model": "llama3-8b",
        "model_shape": calibration.shape_of(model_desc.load(LLAMA)),
        "layouts": {
            "tp2": layout({"static": {"tp": 2}}, ("all_reduce",)),
            "sp2": layout({"static": {"sp": 2}}, ("all_to_all", "all_gather")),
            "pp2": layout({"static": {"pp": 2}}, ("send_recv",)),
        },
    }


def _plan(tmp_path: Path, profile: dict[str, Any], tag: str) -> tuple[dict[str, Any], str]:
    path = tmp_path / f"{tag}.json"
    path.write_text(json.dumps(profile))
    report = tmp_path / f"plan-{tag}.json"
    out = subprocess.run(
        [*GEARSHIFT, "plan", "--model", str(LLAMA), "--profile", str(path), "--hardware",
         "4xH200", "--unprofiled", "roofline", "--policies", "static", "--rate", "2",
         "--rates", "2", "--requests", "40", "--prompt-len", "512", "--output-len", "64",
         "--no-prune", "--no-progress", "--no-extras", "-o", str(report)],
        check=True, timeout=120, capture_output=True, text=True,
    )  # fmt: skip
    return json.loads(report.read_text()), out.stdout


def _figures(data: dict[str, Any]) -> dict[str, tuple[float, ...]]:
    keys = ("ttft_p50_s", "tpot_p50_s", "output_tokens_per_s")
    return {c["name"]: tuple(float(c["points"][0][k]) for k in keys) for c in data["candidates"]}


def test_slower_measured_collectives_change_the_layouts_that_use_them(tmp_path: Path) -> None:
    base, text = _plan(tmp_path, _profile(1.0), "base")
    slow, _ = _plan(tmp_path, _profile(10.0), "slow")
    a, b = _figures(base), _figures(slow)
    assert set(a) == set(b)
    # Roofline-priced (4 ranks, not in the profile) with the links fitted to the profile.
    assert set(base["priced_from_roofline"]) >= {"onex4", "tp4", "sp4", "pp4"}
    for name in ("tp4", "sp4", "pp4"):
        assert a[name] != b[name], name
    for name in ("tp4", "sp4"):
        # TPOT: every decode step runs them once or more per layer. (PP's one send per stage
        # changes how the micro-batches interleave, not always for the worse at the median.)
        assert b[name][1] > a[name][1], name
    assert a["onex4"] == b["onex4"]  # one rank: no collective
    for name in ("tp2x2", "sp2x2", "pp2x2"):
        assert a[name] == b[name], name  # priced from their measured steps
    # The report names which links came from the profile and which from the preset.
    fitted = {(m["collective"], m["layout"]) for m in base["links"]["from_profile"]}
    assert fitted == {("all_reduce", "tp2"), ("all_to_all", "sp2"), ("all_gather", "sp2"),
                      ("send_recv", "pp2")}  # fmt: skip
    ratio = [
        m1["latency_s"] / m0["latency_s"]
        for m0, m1 in zip(base["links"]["from_profile"], slow["links"]["from_profile"], strict=True)
    ]
    assert all(r == pytest.approx(10.0, rel=1e-6) for r in ratio)
    assert set(base["links"]["from_preset"]) == {"intra_node", "inter_node", "host_device"}
    assert "profile: all_reduce over 2 ranks (tp2)" in text and "preset: host_device" in text


def test_unprofiled_roofline_is_refused_where_no_preset_prices_it(tmp_path: Path) -> None:
    cpu = copy.deepcopy(_profile(1.0))
    cpu.update(device="AMD EPYC", device_kind="cpu")
    with pytest.raises(pricing.HardwareError, match="--unprofiled roofline"):
        pricing.from_profile(calibration.from_dict(cpu), None, None, "roofline")
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(cpu))
    out = subprocess.run(
        [*GEARSHIFT, "plan", "--model", str(LLAMA), "--hardware", "2xH200", "--unprofiled",
         "roofline", "--rate", "1"],
        timeout=60, capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 2 and "--unprofiled: only with --profile" in out.stderr


def test_without_unprofiled_the_measured_links_price_no_candidate() -> None:
    priced = pricing.from_profile(calibration.from_dict(_profile(1.0)), None, None)
    assert priced.links and priced.hardware.measured
    assert priced.links_json()["used_by"].startswith("no candidate")
