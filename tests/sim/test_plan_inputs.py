"""Every input of `gearshift plan` and `gearshift profile` is honoured or refused naming its flag
(exit 2), never silently ignored, and a refused or failed command leaves no file behind: traffic
flags beside --traffic, empty values, non-finite numbers, a plan with no recommendation, output
paths checked before the work, extras flags that would be ignored, and a hardware file priced as
the user's file rather than as a preset (docs/planning.md, "`gearshift plan`")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gearshift.operator.cli import main
from gearshift.operator.sim import calibration, hardware, planning, pricing
from gearshift.operator.sim.hardware import HardwareError
from gearshift.operator.sim.traffic import Traffic, TrafficError

MODEL = Path(__file__).parent / "fixtures" / "random_qwen3_3layer_config.json"
BASE = ("--model", str(MODEL), "--hardware", "2xH200", "--requests", "20")
HW = {
    "device": {"name": "X", "flops": {"bf16": 1e15}, "memory_bytes": 8e10,
               "memory_bandwidth": 3e12},
    "count": 2,
    "intra_node": {"bandwidth": 4.5e11, "latency": 3e-6},
}  # fmt: skip


def _plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc = main(["plan", *args, "--no-progress"])
    out, err = capsys.readouterr()
    return rc, out, err


def _strict_json(text: str) -> Any:
    def refuse(constant: str) -> None:
        raise AssertionError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the simulation starts: a refusal must come before any work."""

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("the plan ran")

    monkeypatch.setattr("gearshift.operator.sim.planning.plan_deployment", boom)


def _traffic_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "traffic.yaml"
    path.write_text(text)
    return str(path)


# Item 1: --traffic FILE and the traffic flags.


@pytest.mark.parametrize(
    "flag",
    [["--rate", "2"], ["--requests", "5"], ["--seed", "3"], ["--burstiness", "2"],
     ["--prompt-len", "64"], ["--output-len", "64"]],
)  # fmt: skip
def test_a_traffic_flag_beside_a_traffic_file_is_refused_naming_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_work: None, flag: list[str]
) -> None:
    traffic = _traffic_file(tmp_path, "rate: 2\nrequests: 40\n")
    rc, out, err = _plan(capsys, "--model", str(MODEL), "--hardware", "2xH200",
                         "--traffic", traffic, *flag)  # fmt: skip
    assert rc == 2 and out == ""
    assert f"error: {flag[0]}: not with --traffic" in err, err


def test_the_traffic_flags_keep_their_documented_defaults(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc, out, err = _plan(capsys, "--model", str(MODEL), "--hardware", "2xH200", "--rate", "2",
                         "--policies", "static", "--rates", "2", "--no-extras",
                         "--json")  # fmt: skip
    assert rc == 0, err
    about = json.loads(json.loads(out)["traffic"])
    assert about == {"rate": 2.0, "burstiness": 1.0, "prompt": {"preset": "sharegpt"},
                     "requests": 300, "seed": 0}  # fmt: skip


# Item 2: an empty value is not a value left out.


@pytest.mark.parametrize(
    "flag", ["--goodput", "--rates", "--policies", "--tetris-rates", "--prompt-len",
             "--output-len"],
)  # fmt: skip
def test_an_empty_value_is_refused_naming_the_flag(
    capsys: pytest.CaptureFixture[str], no_work: None, flag: str
) -> None:
    rc, out, err = _plan(capsys, *BASE, "--rate", "2", flag, "")
    assert rc == 2 and out == "" and f"error: {flag}: empty" in err, err


def test_an_empty_traffic_hardware_or_model_is_refused_naming_the_flag(
    capsys: pytest.CaptureFixture[str], no_work: None
) -> None:
    rc, _, err = _plan(capsys, *BASE, "--rate", "2", "--traffic", "")
    assert rc == 2 and "error: --traffic: empty" in err, err
    rc, _, err = _plan(capsys, "--model", str(MODEL), "--hardware", "", "--rate", "2")
    assert rc == 2 and "error: --hardware: empty" in err, err
    rc, _, err = _plan(capsys, "--model", "", "--hardware", "2xH200", "--rate", "2")
    assert rc == 2 and "error: --model: empty" in err, err


# Item 3: non-finite numbers.


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--rate", "inf"], "--rate"),
        (["--rate", "nan"], "--rate"),
        (["--rate", "2", "--rates", "1,inf"], "--rates"),
        (["--rate", "2", "--burstiness", "inf"], "--burstiness"),
        (["--rate", "2", "--tetris-rates", "inf"], "--tetris-rates"),
        (["--rate", "2", "--goodput", "ttft:inf"], "ttft"),
    ],
)
def test_a_non_finite_flag_is_refused_naming_it(
    capsys: pytest.CaptureFixture[str], no_work: None, args: list[str], named: str
) -> None:
    rc, out, err = _plan(capsys, *BASE, *args)
    assert rc == 2 and out == "" and named in err and "finite" in err, err


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("rate: .inf\n", "traffic.rate"),
        ("rate: .nan\n", "traffic.rate"),
        ("rate: 2\nburstiness: .inf\n", "traffic.burstiness"),
        ("rate: 2\noutput: {lognormal: {median: .inf, p90: .inf}}\n", "lognormal.median"),
    ],
)
def test_a_non_finite_traffic_field_is_refused_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_work: None, text: str, named: str
) -> None:
    with pytest.raises(TrafficError, match="finite"):
        Traffic.load(_traffic_file(tmp_path, text))
    rc, out, err = _plan(capsys, "--model", str(MODEL), "--hardware", "2xH200",
                         "--traffic", _traffic_file(tmp_path, text))  # fmt: skip
    assert rc == 2 and out == "" and named in err and "finite" in err, err


@pytest.mark.parametrize(
    ("path", "value", "named"),
    [
        (("device", "flops", "bf16"), float("inf"), "device.flops.bf16"),
        (("device", "flops", "bf16"), float("nan"), "device.flops.bf16"),
        (("device", "memory_bandwidth"), float("inf"), "device.memory_bandwidth"),
        (("device", "memory_bytes"), "inf", "device.memory_bytes"),
        (("intra_node", "bandwidth"), float("nan"), "intra_node.bandwidth"),
        (("intra_node", "latency"), float("nan"), "intra_node.latency"),
        (("intra_node", "latency"), float("inf"), "intra_node.latency"),
    ],
)
def test_a_non_finite_hardware_figure_is_refused_naming_the_key(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    no_work: None,
    path: tuple[str, ...],
    value: object,
    named: str,
) -> None:
    data = json.loads(json.dumps(HW))
    leaf = data
    for key in path[:-1]:
        leaf = leaf[key]
    leaf[path[-1]] = value
    for suffix in ("json", "yaml"):
        f = tmp_path / f"hw.{suffix}"
        # json.dumps writes NaN/Infinity, as a hand-written file might; YAML gets .nan/.inf.
        f.write_text(json.dumps(data) if suffix == "json" else _yaml(data))
        with pytest.raises(HardwareError, match="finite"):
            hardware.load(str(f))
        rc, out, err = _plan(capsys, "--model", str(MODEL), "--hardware", str(f), "--rate", "2")
        assert rc == 2 and out == "" and named in err, err


def _yaml(data: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(data)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_profile_figure_is_refused_naming_the_key(value: float) -> None:
    fit = {"a": 0.001, "b": 1e-5, "c": 1e-8}
    layout = {
        "policy": {"static": {"tp": 2}},
        "kv_blocks": 100,
        "block_size": 16,
        "step_cost": {"format": "gearshift.step-cost/1", "prefill": {**fit, "a": value},
                      "decode": fit, "about": dict.fromkeys(calibration.GRID_KEYS, 512)},
    }  # fmt: skip
    data = {
        "format": calibration.FORMAT, "device": "NVIDIA H200", "device_kind": "cuda",
        "devices": 2, "engine_version": "0.1.0", "dtype": "bfloat16", "model": "m",
        "model_shape": dict.fromkeys(calibration.SHAPE_KEYS, 64), "layouts": {"tp2": layout},
    }  # fmt: skip
    with pytest.raises(calibration.ProfileError, match=r"step_cost\.prefill\.a: .*finite"):
        calibration.parse(json.dumps(data))
    points = [[4096.0, 1e-5], [65536.0, value]]
    layout["collectives"] = {"all_reduce": {"ranks": 2, "points": points}}
    layout["step_cost"]["prefill"] = fit  # type: ignore[index]
    with pytest.raises(calibration.ProfileError, match=r"all_reduce\.points"):
        calibration.parse(json.dumps(data))


# Item 4: a plan with no recommendation says why and fails.


def test_no_recommendation_because_of_the_inputs_exits_2_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_file = tmp_path / "plan.json"
    rc, out, err = _plan(capsys, *BASE, "--rate", "2", "--prompt-len", "50000",
                         "--max-model-len", "1024", "--json", "-o", str(out_file))  # fmt: skip
    assert rc == 2
    assert "error: no recommendation: every one of the 20 requests" in err
    assert "--max-model-len 1024" in err and "recommended: none" in err
    data = _strict_json(out)
    assert data["recommended"] is None and "--max-model-len 1024" in data["reason"]
    assert list(tmp_path.iterdir()) == []  # a failed plan writes no report


def test_no_recommendation_for_another_reason_exits_1_naming_each_candidate(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def nothing(*args: object, **kwargs: object) -> planning.Recommendation:
        return planning.Recommendation(None, "no candidate could be simulated", [])

    monkeypatch.setattr("gearshift.operator.sim.planning.decide", nothing)
    rc, out, err = _plan(capsys, *BASE, "--rate", "2", "--policies", "static", "--json")
    assert rc == 1
    data = _strict_json(out)
    assert data["recommended"] is None
    assert data["reason"].startswith("no candidate served a request of the declared traffic")
    assert all(c["name"] in data["reason"] for c in data["candidates"])
    assert f"error: no recommendation: {data['reason']}" in err


# Item 5: output paths, checked before the work; written whole or not at all.


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["-o", "/nonexistent-dir/x.json"], "--output /nonexistent-dir/x.json: the directory"),
        (["-o", "{tmp}"], "is a directory"),
        (["--png", "/nonexistent-dir/x.png"], "--png /nonexistent-dir/x.png: the directory"),
        (["--png", "{tmp}/x.badext"], "--png"),
        (["--png", "{tmp}/plot"], "--png"),
        (["-o", "{tmp}/x.png", "--png", "{tmp}/x.png"], "the same file as --output"),
        (["-o", "{tmp}/ok.json", "--png", "/nonexistent-dir/x.png"], "--png"),
    ],
)
def test_a_bad_output_path_is_refused_before_any_work(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    no_work: None,
    args: list[str],
    named: str,
) -> None:
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    rc, out, err = _plan(capsys, *BASE, "--rate", "2", *args)
    assert rc == 2 and out == "" and named in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_leaves_neither_file_nor_a_temporary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(data: object, path: Path) -> None:
        path.write_bytes(b"half a png")
        raise OSError("disk full")

    monkeypatch.setattr("gearshift.operator.commands.plan.plot", broken)
    args = ("--rate", "2", "--policies", "static", "--no-extras")
    rc, _, err = _plan(capsys, *BASE, *args, "-o", str(tmp_path / "ok.json"),
                       "--png", str(tmp_path / "x.png"))  # fmt: skip
    assert rc == 1 and "disk full" in err and "nothing was written" in err
    assert list(tmp_path.iterdir()) == []


def test_the_outputs_are_written_in_full(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report, png = tmp_path / "plan.json", tmp_path / "plan.svg"
    report.write_text("an older report")
    rc, _, err = _plan(capsys, *BASE, "--rate", "2", "--policies", "static", "--no-extras",
                       "-o", str(report), "--png", str(png))  # fmt: skip
    assert rc == 0, err
    assert _strict_json(report.read_text())["recommended"]
    assert png.read_text().lstrip().startswith("<?xml")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json", "plan.svg"]


def test_replacing_keeps_the_old_file_when_the_write_fails(tmp_path: Path) -> None:
    from gearshift.operator import outputs

    target = tmp_path / "p.json"
    target.write_text("old")
    with pytest.raises(RuntimeError), outputs.replacing(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("interrupted")
    assert target.read_text() == "old" and list(tmp_path.iterdir()) == [target]
    outputs.write_text(target, "new")
    assert target.read_text() == "new" and list(tmp_path.iterdir()) == [target]


@pytest.mark.parametrize("layouts", [[], ["--layouts", "one"]])
@pytest.mark.parametrize(("output", "named"), [("/nonexistent-dir/p.json", "the directory"),
                                               ("{tmp}", "is a directory")])  # fmt: skip
def test_profile_checks_its_output_before_profiling(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    layouts: list[str],
    output: str,
    named: str,
) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("the engine started")

    monkeypatch.setattr("gearshift.worker.launch.start_engine", boom)
    output = output.replace("{tmp}", str(tmp_path))
    rc = main(["profile", "--model", str(MODEL), *layouts, "-o", output])
    err = capsys.readouterr().err
    assert rc == 2 and f"error: --output {output}: {named}" in err, err


# Item 6: flags that would be ignored.


@pytest.mark.parametrize("flag", [["--sidp-context", "5"], ["--tetris-rates", "1,2"]])
def test_extras_flags_are_refused_where_the_extras_are_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_work: None, flag: list[str]
) -> None:
    rc, _, err = _plan(capsys, *BASE, "--rate", "2", "--no-extras", *flag)
    assert rc == 2 and f"error: {flag[0]}: not with --no-extras" in err, err
    profile = tmp_path / "profile.json"  # refused before it is read
    rc, _, err = _plan(capsys, "--model", str(MODEL), "--profile", str(profile),
                       "--rate", "2", *flag)  # fmt: skip
    assert rc == 2 and f"error: {flag[0]}: not with --profile" in err, err


@pytest.mark.parametrize(
    "flags", [["--collective-sizes", "4KiB,1MiB"], ["--collective-repeats", "3"]]
)
def test_collective_flags_are_refused_without_a_multi_rank_layout(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    flags: list[str],
) -> None:
    def stub(*args: object, **kwargs: object) -> None:
        raise ValueError("stub engine config")

    monkeypatch.setattr("gearshift.worker.server.settings.engine_config", stub)
    out = str(tmp_path / "p.json")
    rc = main(["profile", "--model", str(MODEL), "--layouts", "one", *flags, "-o", out])
    err = capsys.readouterr().err
    assert rc == 2 and f"error: {flags[0]}: --layouts one has no multi-rank layout" in err, err
    # With a multi-rank layout they are honoured: the checks pass, up to the engine's config.
    rc = main(["profile", "--model", str(MODEL), "--layouts", "one,tp2", *flags, "-o", out])
    assert rc == 2 and "error: stub engine config" in capsys.readouterr().err


# Item 7: a hardware file is the user's, not a preset, and is not scaled unless it asks.


def test_a_hardware_file_is_described_as_the_users_and_taken_as_given(tmp_path: Path) -> None:
    f = tmp_path / "hw.json"
    f.write_text(json.dumps(HW))
    priced = pricing.choose(hardware.load(str(f)), None, str(f))
    assert priced.describe.startswith(f"the hardware file {f} (device X), its figures as given")
    assert "preset" not in priced.describe.split(",")[0]
    assert priced.hardware.device.flops == {"bf16": 1e15}
    assert priced.hardware.device.memory_bandwidth == 3e12
    f.write_text(json.dumps({**HW, "efficiencies": "fitted"}))
    scaled = pricing.choose(hardware.load(str(f)), None, str(f))
    assert scaled.describe.startswith(f"the hardware file {f} (device X) scaled by efficiencies")
    assert scaled.hardware.device.flops == {"bf16": 1e15 * pricing.COMPUTE_EFFICIENCY}
    # A preset is scaled as before.
    assert pricing.choose(hardware.load("2xH200"), None).describe.startswith(
        "the H200 preset scaled by efficiencies"
    )
    f.write_text(json.dumps({**HW, "efficiencies": "yes"}))
    with pytest.raises(HardwareError, match="efficiencies: none or fitted"):
        hardware.load(str(f))


def test_plan_says_which_pricing_a_hardware_file_took(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "hw.yaml"
    f.write_text(_yaml(HW))
    rc, out, err = _plan(capsys, "--model", str(MODEL), "--hardware", str(f), "--rate", "2",
                         "--requests", "20", "--policies", "static", "--no-extras")  # fmt: skip
    assert rc == 0, err
    first = out.splitlines()[0]
    assert first.startswith(f"pricing: the hardware file {f} (device X), its figures as given")
    assert "  file: intra_node: alpha 3.0 us, 450 GB/s" in out
