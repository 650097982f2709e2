"""What a calibration profile must say before `plan --profile` prices from it: the model it
measured (``model_shape``, ``dtype``) is the planned one, its numbers are finite, its layouts fit
its devices, its degrees are integers; and a plan past the measured grid says so
(sim/calibration.py)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gearshift.operator.sim import calibration, model_desc

GEARSHIFT = [sys.executable, "-m", "gearshift.operator.cli"]
FIXTURES = Path(__file__).parent / "fixtures"
LLAMA = FIXTURES / "llama3_8b_config.json"
QWEN = FIXTURES / "random_qwen3_3layer_config.json"  # float32, head_dim set explicitly
# The largest measured steps: the default grid at 2048 batched tokens.
GRID = {
    "prefill_max_tokens": 2048,
    "prefill_max_attended": 1.3e6,
    "decode_max_tokens": 32,
    "decode_max_attended": 24608.0,
}


def _layout(policy: dict[str, Any]) -> dict[str, Any]:
    fit = {"a": 0.001, "b": 1e-5, "c": 1e-8}
    return {
        "policy": policy,
        "kv_blocks": 20000,
        "block_size": 16,
        "step_cost": {
            "format": "gearshift.step-cost/1",
            "prefill": dict(fit),
            "decode": dict(fit),
            "about": dict(GRID),
        },
    }


def _profile(config: Path = LLAMA) -> dict[str, Any]:
    """An H200 profile of one and tp2 of ``config``'s model, in its dtype."""
    desc = model_desc.load(config)
    return {
        "format": calibration.FORMAT,
        "device": "NVIDIA H200",
        "device_kind": "cuda",
        "devices": 2,
        "engine_version": "0.1.0",
        "dtype": desc.dtype,
        "model": str(config),
        "model_shape": calibration.shape_of(desc),
        "layouts": {"one": _layout({"static": {}}), "tp2": _layout({"static": {"tp": 2}})},
    }


def _refused(data: Any, named: str) -> str:
    with pytest.raises(calibration.ProfileError) as err:
        calibration.parse(json.dumps(data), "p")
    assert str(err.value).startswith(named + ":"), err.value
    return str(err.value)


def test_the_profile_records_the_model_it_measured_and_reads_it_back(tmp_path: Path) -> None:
    profile = calibration.from_dict(_profile())
    assert profile.model_shape == {
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "head_dim": 128,
    }
    profile.save(tmp_path / "p.json")
    assert calibration.load(tmp_path / "p.json") == profile
    assert calibration.differences(profile, model_desc.load(LLAMA)) == []


INF, NAN = float("inf"), float("nan")
POINTS = {"all_reduce": {"ranks": 2, "points": [[4096, 1e-4], [65536, INF]]}}


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        # JSON's NaN and Infinity, which Python's reader takes: refused naming the key.
        ("layouts.one.step_cost.prefill.a", NAN, ""),
        ("layouts.one.step_cost.decode.c", INF, ""),
        ("layouts.tp2.step_cost.prefill.b", -INF, ""),
        ("layouts.one.step_cost.decode.a", 10**400, ""),  # past a float's range
        ("layouts.one.step_cost.decode_scale", [[1, INF], [8, 1.0]], ""),
        ("layouts.one.step_cost.decode_scale", [[1.5, 1.0], [8, 1.0]], ""),
        ("layouts.one.step_cost.about.decode_max_tokens", NAN, ""),
        ("layouts.tp2.collectives", POINTS, ".all_reduce.points"),
        ("model_shape.hidden_size", 4096.5, ""),
        ("model_shape.head_dim", 0, ""),
        ("dtype", "bf16", ""),
    ],
)
def test_a_number_that_prices_nothing_is_refused_naming_its_key(
    key: str, value: Any, named: str
) -> None:
    data = _profile()
    *path, last = key.split(".")
    at = data
    for p in path:
        at = at[p]
    at[last] = value
    _refused(data, f"p.{key}{named}")


def test_a_negative_fitted_term_is_kept() -> None:
    """Least squares may fit a term below zero (the recorded H200 fit's decode ``c`` is); the
    step time is clamped above zero where it is read, so the profile stands."""
    data = _profile()
    data["layouts"]["one"]["step_cost"]["decode"]["c"] = -2e-7
    assert calibration.from_dict(data).layouts["one"].step_cost.decode.c == -2e-7


def test_a_layout_needing_more_devices_than_the_profile_has_is_refused() -> None:
    data = _profile()
    data["layouts"]["tp8"] = _layout({"static": {"tp": 8}})
    message = _refused(data, "p.layouts.tp8")
    assert "8 devices" in message and "devices (2)" in message
    data["devices"] = 8
    assert "tp8" in calibration.from_dict(data).layouts


@pytest.mark.parametrize(
    ("policy", "named"),
    [
        ({"static": {"tp": "abc"}}, "p.layouts.tp2.policy.static.tp"),
        ({"static": {"tp": 2.0}}, "p.layouts.tp2.policy.static.tp"),
        ({"static": {"tp": 0}}, "p.layouts.tp2.policy.static.tp"),
        ({"static": ["tp", 2]}, "p.layouts.tp2.policy.static"),
        ({"shift": {"sp": "2"}}, "p.layouts.tp2.policy.shift.sp"),
    ],
)
def test_a_degree_that_is_not_an_integer_is_refused_naming_its_key(
    policy: dict[str, Any], named: str
) -> None:
    data = _profile()
    data["layouts"]["tp2"]["policy"] = policy
    _refused(data, named)


def test_a_profile_without_the_measured_model_is_refused_with_a_word_to_profile_again() -> None:
    data = _profile()
    del data["model_shape"]
    assert "profile again" in _refused(data, "p.model_shape")
    old = _profile()
    old["format"] = "gearshift.profile/1"
    del old["model_shape"]
    message = _refused(old, "p.format")
    assert "profile again with gearshift profile --layouts" in message
    grid = _profile()
    del grid["layouts"]["tp2"]["step_cost"]["about"]["prefill_max_tokens"]
    _refused(grid, "p.layouts.tp2.step_cost.about.prefill_max_tokens")


def test_a_cpu_profile_of_a_float16_checkpoint_ran_it_in_bfloat16() -> None:
    """``--dtype auto`` runs a float16 checkpoint in bfloat16 on a CPU (worker/config.py): that
    profile is of the float16 model; on a GPU it is not."""
    desc = model_desc.load(LLAMA)
    fp16 = model_desc.ModelDesc(**{**desc.__dict__, "dtype": "float16"})
    data = _profile()
    data.update(device="AMD EPYC", device_kind="cpu", dtype="bfloat16")
    assert calibration.differences(calibration.from_dict(data), fp16) == []
    data.update(device="NVIDIA H200", device_kind="cuda")
    assert calibration.differences(calibration.from_dict(data), fp16) == [
        ("dtype", "bfloat16", "float16")
    ]


def _plan(tmp_path: Path, profile: dict[str, Any], model: Path, *flags: str) -> Any:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    return subprocess.run(
        [*GEARSHIFT, "plan", "--model", str(model), "--profile", str(path), "--rate", "2",
         "--requests", "30", "--no-progress", "--no-extras", *flags],
        timeout=120, capture_output=True, text=True,
    )  # fmt: skip


def test_plan_refuses_a_profile_of_another_model_naming_each_field(tmp_path: Path) -> None:
    # A profile of the random 3-layer Qwen3 (float32), offered for Llama-3-8B (bfloat16).
    out = _plan(tmp_path, _profile(QWEN), LLAMA)
    assert out.returncode == 2, out.stdout
    err = out.stderr
    where = f"error: --profile {tmp_path / 'profile.json'}"
    assert err.startswith(f"{where}: the profile measured another model ({QWEN}) than"), err
    assert "model_shape.num_hidden_layers 3 vs --model's num_hidden_layers 32" in err
    assert "model_shape.hidden_size 64 vs --model's hidden_size 4096" in err
    assert "dtype float32 vs --model's torch_dtype bfloat16" in err
    assert "profile it (gearshift profile --layouts)" in err


def test_plan_refuses_a_profile_measured_in_another_dtype(tmp_path: Path) -> None:
    data = _profile()
    data["dtype"] = "float32"  # gearshift profile --dtype float32 of the bf16 model
    out = _plan(tmp_path, data, LLAMA)
    assert out.returncode == 2
    assert "dtype float32 vs --model's torch_dtype bfloat16" in out.stderr
    assert "model_shape." not in out.stderr  # the shape agrees: only the dtype is named


def test_a_shape_field_alone_is_enough_to_refuse(tmp_path: Path) -> None:
    data = _profile()
    data["model_shape"]["num_key_value_heads"] = 32  # no GQA: another model's KV reads
    out = _plan(tmp_path, data, LLAMA)
    assert out.returncode == 2
    assert "model_shape.num_key_value_heads 32 vs --model's num_key_value_heads 8" in out.stderr


def test_plan_says_where_it_priced_beyond_the_measured_grid(tmp_path: Path) -> None:
    # Short prompts in short steps stay inside the measured grid: no note.
    inside = _plan(
        tmp_path, _profile(), LLAMA, "--prompt-len", "64", "--output-len", "16",
        "--max-num-batched-tokens", "2048", "--json",
    )  # fmt: skip
    assert inside.returncode == 0, inside.stderr
    data = json.loads(inside.stdout)
    assert data["beyond_measured_grid"] == {} and data["pricing_notes"] == []
    assert "measured grid" not in inside.stderr
    # 4000-token prompts in 8192-token steps: priced past it, said on stderr and in the JSON.
    beyond = _plan(
        tmp_path, _profile(), LLAMA, "--prompt-len", "4000", "--output-len", "16", "--json"
    )
    assert beyond.returncode == 0, beyond.stderr
    data = json.loads(beyond.stdout)
    grid = data["beyond_measured_grid"]
    assert set(grid) == {"one", "tp2"}
    tokens = grid["one"]["prefill_max_tokens"]
    assert tokens["measured"] == 2048 and 2048 < tokens["used"] <= 8192
    assert grid["one"]["prefill_max_attended"]["used"] > GRID["prefill_max_attended"]
    (note,) = data["pricing_notes"]
    assert note.startswith("priced beyond the profile's measured grid")
    assert "one: prefill steps of up to 2048 tokens measured" in note
    assert note in beyond.stderr
    # Without --json the note is on stdout, with the other pricing lines.
    text = _plan(tmp_path, _profile(), LLAMA, "--prompt-len", "4000", "--output-len", "16")
    assert note in text.stdout


def test_a_priced_step_is_the_fits_own_figure() -> None:
    """The grid watch only notes: a step costs what the layout's fit says."""
    from gearshift.operator.sim import pricing

    profile = calibration.from_dict(_profile())
    priced = pricing.from_profile(profile, None, None)
    one = priced.apply([c for c in _candidates(priced) if c.name == "onex2"])[0]
    assert isinstance(one.cost, calibration.WatchedCost)
    assert one.cost.cost == profile.layouts["one"].step_cost


def _candidates(priced: Any) -> list[Any]:
    from gearshift.operator.sim.candidates import PlanSettings, enumerate_candidates

    return enumerate_candidates(model_desc.load(LLAMA), priced.hardware, PlanSettings(), {"static"})


def test_the_shape_is_compared_field_by_field() -> None:
    base = calibration.from_dict(_profile())
    other = copy.deepcopy(_profile())
    other["model_shape"].update(vocab_size=32000, head_dim=64)
    diffs = calibration.differences(calibration.from_dict(other), model_desc.load(LLAMA))
    assert diffs == [("vocab_size", 32000, 128256), ("head_dim", 64, 128)]
    assert calibration.differences(base, model_desc.load(LLAMA), "float32") == [
        ("dtype", "bfloat16", "float32")
    ]
