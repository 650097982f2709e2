"""Calibration profiles (issue 30, item 1): the file format's refusals, the fitted efficiencies
re-derived from the recorded GPU runs, and `plan --profile` on a profile of this machine."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from gearshift.operator.sim import calibration, model_desc, pricing
from gearshift.operator.sim.hardware import HardwareError, preset

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
GEARSHIFT = [sys.executable, "-m", "gearshift.operator.cli"]
LLAMA = Path(__file__).parent / "fixtures" / "llama3_8b_config.json"
# The largest steps the profile measured (the default grid's, at 2048 batched tokens).
GRID = {
    "prefill_max_tokens": 2048,
    "prefill_max_attended": 1.3e6,
    "decode_max_tokens": 32,
    "decode_max_attended": 24608.0,
}


def _profile(**top: object) -> dict[str, object]:
    fit = {"a": 0.001, "b": 1e-5, "c": 1e-8}
    layout = {
        "policy": {"static": {"tp": 2}},
        "kv_blocks": 100,
        "block_size": 16,
        "step_cost": {
            "format": "gearshift.step-cost/1",
            "prefill": fit,
            "decode": fit,
            "about": dict(GRID),
        },
    }
    data: dict[str, object] = {
        "format": calibration.FORMAT,
        "device": "NVIDIA H200",
        "device_kind": "cuda",
        "devices": 2,
        "engine_version": "0.1.0",
        "dtype": "bfloat16",
        "model": "llama3-8b",
        "model_shape": calibration.shape_of(model_desc.load(LLAMA)),
        "layouts": {"tp2": layout},
    }
    data.update(top)
    return data


def test_a_well_formed_profile_round_trips(tmp_path: Path) -> None:
    profile = calibration.from_dict(_profile())
    path = tmp_path / "p.json"
    profile.save(path)
    again = calibration.load(path)
    assert again == profile
    assert again.layouts["tp2"].step_cost.prefill.a == 0.001


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"format": "gearshift.profile/0"}, "profile.format"),
        ({"devices": 0}, "profile.devices"),
        ({"device_kind": "tpu"}, "profile.device_kind"),
        ({"colour": "red"}, "profile.colour"),
        ({"layouts": {}}, "profile.layouts"),
        ({"layouts": {"tp4": _profile()["layouts"]["tp2"]}}, "profile.layouts.tp4.policy"),  # type: ignore[index]
    ],
)
def test_a_malformed_profile_is_refused_naming_the_key(change: dict, named: str) -> None:
    with pytest.raises(calibration.ProfileError, match=named.replace(".", r"\.")):
        calibration.from_dict(_profile(**change))


GOOD_POINTS = [[4096.0, 1e-4], [16777216.0, 2e-3]]


def test_measured_collectives_round_trip(tmp_path: Path) -> None:
    data = _profile()
    data["layouts"]["tp2"]["collectives"] = {"all_reduce": {"ranks": 2, "points": GOOD_POINTS}}  # type: ignore[index]
    path = tmp_path / "p.json"
    calibration.from_dict(data).save(path)
    again = calibration.load(path)
    assert again.layouts["tp2"].collectives == {
        "all_reduce": calibration.Collective(2, GOOD_POINTS)
    }
    assert json.loads(path.read_text())["layouts"]["tp2"]["collectives"] == {
        "all_reduce": {"ranks": 2, "points": GOOD_POINTS}
    }


@pytest.mark.parametrize(
    ("collectives", "named"),
    [
        ([], "collectives"),
        ({"broadcast": {"ranks": 2, "points": GOOD_POINTS}}, "collectives.broadcast"),
        ({"all_reduce": GOOD_POINTS}, "collectives.all_reduce"),
        ({"all_reduce": {"ranks": 1, "points": GOOD_POINTS}}, "collectives.all_reduce.ranks"),
        ({"all_reduce": {"ranks": 2}}, "collectives.all_reduce.points"),
        ({"all_reduce": {"ranks": 2, "points": [[4096, 0]]}}, "collectives.all_reduce.points"),
        ({"all_reduce": {"ranks": 2, "points": [[4096, 1e-4]]}}, "collectives.all_reduce.points"),
        ({"all_reduce": {"ranks": 2, "points": [[4096, -1e-4], [8192, 1]]}}, "all_reduce.points"),
        ({"all_reduce": {"ranks": 2, "points": GOOD_POINTS, "x": 1}}, "collectives.all_reduce.x"),
    ],
)
def test_malformed_collectives_are_refused_naming_the_path(collectives: object, named: str) -> None:
    data = _profile()
    data["layouts"]["tp2"]["collectives"] = collectives  # type: ignore[index]
    with pytest.raises(
        calibration.ProfileError, match=r"profile\.layouts\.tp2\..*" + named.replace(".", r"\.")
    ):
        calibration.from_dict(data)


def test_a_bad_step_cost_is_refused_naming_its_key() -> None:
    data = _profile()
    data["layouts"]["tp2"]["step_cost"]["decode"] = {"a": "x", "b": 0, "c": 0}  # type: ignore[index]
    with pytest.raises(calibration.ProfileError, match=r"layouts\.tp2\.step_cost\.decode\.a"):
        calibration.from_dict(data)


def test_hardware_must_agree_with_the_profile() -> None:
    profile = calibration.from_dict(_profile())
    with pytest.raises(HardwareError, match="--hardware 8xH100: the profile was measured on"):
        pricing.from_profile(profile, preset("8xH100"), "8xH100")
    assert pricing.from_profile(profile, preset("8xH200"), "8xH200").hardware.count == 8
    assert pricing.from_profile(profile, None, None).hardware.device.name == "H200"


def test_the_fitted_efficiencies_are_those_of_the_recorded_gpu_runs() -> None:
    """Re-derived from the H200 recordings: roofline over measured mean TTFT (compute) and mean
    TPOT (memory), geometric mean over the runs."""
    runs = [json.loads(p.read_text()) for p in sorted(BENCH.glob("sim_fidelity_h200*.json"))]
    assert runs, "no recorded GPU fidelity run"

    def geomean(figure: str) -> float:
        ratios = [
            r["roofline"] / r["measured"]
            for run in runs
            for r in run["rows"]
            if r["figure"] == figure
        ]
        return math.exp(sum(math.log(x) for x in ratios) / len(ratios))

    assert pytest.approx(geomean("ttft_mean_s"), rel=0.01) == pricing.COMPUTE_EFFICIENCY
    assert pytest.approx(geomean("tpot_mean_s"), rel=0.01) == pricing.MEMORY_EFFICIENCY
    scaled = pricing.scaled_preset(preset("8xH200"))
    assert "scaled by efficiencies" in scaled.describe
    assert scaled.hardware.device.memory_bandwidth < preset("8xH200").device.memory_bandwidth


# Shift 2 is left out: its profile is one fit over both gears (a step does not say which ran),
# and the suite's serial part would pay for one more layout in each model (about 20 s each).
LAYOUTS = ("tp2", "sp2", "pp2")
# Two random Llamas whose fastest 2-rank layout differs on this machine, each by a margin wider
# than the noise. A narrow one (hidden 64, 8 layers): its steps are mostly collectives, TP 2 does
# two all-reduces a layer, SP 2 two all-to-alls, PP 2 one send a stage, and PP 2 ran 1.8-3.3x as
# fast as SP 2 here. A wide, shallow one (hidden 512, 2 layers): its steps are mostly matmuls
# that TP 2 splits, and TP 2 ran 1.2-2.0x as fast as PP 2 (0.96-1.3x SP 2). The fidelity runs'
# own model (hidden 256, 4 layers) had all three within 8-26% of each other, and which one won
# changed from run to run: that engine's "choice" was noise, and the test, an expected failure,
# passed in 6 of 10 runs.
SHAPES = {"collective-bound": (64, 8), "compute-bound": (512, 2)}
# The engine's throughput on the trace is the median of this many runs of the same engine. They
# mostly agree within 3%, with the odd outlier (275 among 305s, 484 among 309-335). Between
# engines started alike, TP 2 on the wide model ranged 240-308 tokens/s, but the profile is taken
# on the same engine and moves with it.
ENGINE_RUNS = 3


def _plan_and_engine(folder: Path, hidden: int, layers: int) -> tuple[dict, dict, dict]:
    """Profile each of LAYOUTS on a random Llama of that shape (fp32, one thread a rank, as the
    fidelity runs use; ``gearshift profile``'s measurement on a small grid) and, on the same
    engine right after, run the fidelity trace (lognormal prompts and outputs, every request at
    once) after a warm-up, ENGINE_RUNS times. Then ``gearshift plan --profile`` plans that trace
    at a rate far above what the engine serves. Returns the plan's output tokens/s per layout, the
    engine's (median), and the plan's report."""
    from benchmarks.sim_fidelity import (
        engine_config,
        fidelity_trace,
        random_llama,
        run_engine,
        traffic_lengths,
    )
    from gearshift.operator.commands.profile_layouts import (
        device_name,
        engine_version,
        layout_policy,
        measured_model,
    )
    from gearshift.operator.sim.profile import ProfileGrid, measure
    from gearshift.worker.launch import start_engine
    from gearshift.worker.policies import policy_json

    # A smaller grid than the fidelity runs': fewer prompt lengths, decode batches (the
    # per-batch correction still has 1 to 32) and contexts. The long context stays near the
    # trace's longest (about 700): with 320 instead, the wide model's plan came out 28-33% under
    # the engine's throughput, against 0-16% with 600. Their repeats and decode steps: with one
    # repeat of 3 steps, the wide model's TP 2 plan came out 7-28% under the engine in 4 runs
    # (CI failed on the 28%, 2026-11-28), against 2-18% in 7 runs with 2 repeats of 5.
    grid = ProfileGrid(
        prompt_lens=(16, 128, 500),
        prefill_batches=(1, 3),
        decode_batches=(1, 4, 16, 32),
        contexts=(32, 600),
        decode_steps=5,
        repeats=2,
    )
    model = random_llama(folder / "m", hidden=hidden, layers=layers)
    config = engine_config(str(model), 1, "float32")
    trace = fidelity_trace(32, 0.0, 0)
    layouts: dict[str, calibration.LayoutProfile] = {}
    measured: dict[str, float] = {}
    spread: dict[str, list[int]] = {}
    for name in LAYOUTS:
        policy = layout_policy(name)
        engine = start_engine(config, policy_json.from_dict(policy))
        try:
            cost = measure(engine, grid, 0).model({"model": str(model)})
            layouts[name] = calibration.LayoutProfile(
                policy, engine.blocks.num_blocks, engine.blocks.block_size, cost
            )
            run_engine(engine, trace[:8])  # warm-up: the trace's first shapes
            runs = [run_engine(engine, trace)["output_tokens_per_s"] for _ in range(ENGINE_RUNS)]
            measured[name] = statistics.median(runs)
            spread[name] = [round(r) for r in runs]
        finally:
            engine.shutdown()
    device, kind = device_name(str(config.device))
    prof = folder / "profile.json"
    shape, dtype = measured_model(config)
    calibration.CalibrationProfile(
        device, kind, 2, engine_version(), dtype, str(model), shape, layouts
    ).save(prof)
    traffic = folder / "traffic.json"
    traffic.write_text(
        json.dumps(
            {
                "rate": 1000,
                "requests": 32,
                "seed": 0,
                **traffic_lengths(),
            }
        )
    )
    report = folder / "plan.json"
    out = subprocess.run(
        [*GEARSHIFT, "plan", "--model", str(model), "--profile", str(prof), "--traffic",
         str(traffic), "--rates", "1000", "--no-prune", "--no-progress", "-o", str(report),
         "--max-model-len", "1024", "--max-num-batched-tokens", "512"],
        check=True, timeout=120, capture_output=True, text=True, cwd=folder,
    )  # fmt: skip
    assert "pricing: the profile" in out.stdout
    data = json.loads(report.read_text())
    assert data["pricing"].startswith("the profile")
    # The one-rank layout is not profiled: the plan would run it as two replicas, which is not
    # measured here; the plan must list it as excluded.
    assert "onex2" in data["excluded_not_in_profile"]
    ran = {c["name"]: c["points"][0]["output_tokens_per_s"] for c in data["candidates"]}
    assert set(ran) == set(LAYOUTS)
    print(f"engine runs (tokens/s): {spread}")
    return ran, measured, data


@pytest.mark.serial
def test_plan_with_a_profile_of_this_machine_reproduces_the_engines_choice(
    tmp_path: Path,
) -> None:
    """For each shape, the plan's highest-throughput candidate must be the layout the engine ran
    fastest, or be reported in a tie with it and measure within the simulator's stated
    throughput error of it. And the engine's fastest layout differs between the two shapes, so a
    plan that always picked one layout could not pass."""
    from gearshift.operator.sim.error_band import MEASURED

    best: dict[str, str] = {}
    for shape, (hidden, layers) in SHAPES.items():
        folder = tmp_path / shape
        folder.mkdir()
        ran, measured, data = _plan_and_engine(folder, hidden, layers)
        pick = max(ran, key=lambda n: ran[n])
        best[shape] = max(measured, key=lambda n: measured[n])
        why = f"{shape}: plan {ran}, engine {measured}, ties {data.get('ties')}"
        print(why)
        # The recommendation (no SLO given: the lowest p99 TTFT) is the engine's fastest or in
        # a tie with it.
        assert data["recommended"] == best[shape] or best[shape] in data["ties"], why
        if pick != best[shape]:
            assert best[shape] in data["ties"] and pick in data["ties"], why
            assert measured[pick] >= (1 - MEASURED.throughput) * measured[best[shape]], why
    assert len(set(best.values())) == 2, f"the engine's fastest layout per shape: {best}"
