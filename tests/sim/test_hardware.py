"""Hardware descriptions and model shapes for the roofline model: presets parse with the NxNAME
syntax, files are validated naming the field, and a config.json gives the right sizes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gearshift.operator.sim import hardware, model_desc
from gearshift.operator.sim.hardware import HardwareError
from gearshift.operator.sim.model_desc import ModelDescError

LLAMA3_8B = Path(__file__).parent / "fixtures" / "llama3_8b_config.json"


def test_presets_parse_with_a_device_count() -> None:
    hw = hardware.load("8xH200")
    assert hw.count == 8 and hw.devices_per_node == 8
    assert hw.device.memory_bytes == 141e9 and hw.device.memory_bandwidth == 4.8e12
    assert hw.device.peak("bf16") == 989e12
    one = hardware.load("h100")
    assert one.count == 1 and one.device.name == "H100"
    assert hardware.load("16xL4").link(16) == hardware.load("16xL4").inter_node
    assert hw.link(8) == hw.intra_node


@pytest.mark.parametrize("spec", ["8xA100", "x8H200", "0xH200", "", "8 H200"])
def test_an_unknown_preset_is_refused_naming_the_flag(spec: str) -> None:
    with pytest.raises(HardwareError, match="--hardware"):
        hardware.load(spec)


def test_a_yaml_file_describes_custom_hardware(tmp_path: Path) -> None:
    f = tmp_path / "hw.yaml"
    f.write_text(
        "device: {name: X, flops: {bf16: 1.0e14}, memory_bytes: 4.0e10, memory_bandwidth: 1.0e12}\n"
        "count: 4\ndevices_per_node: 2\n"
        "intra_node: {bandwidth: 1.0e11, latency: 2.0e-6}\n"
        "inter_node: {bandwidth: 1.0e10, latency: 1.0e-5}\n"
    )
    hw = hardware.load(str(f))
    assert (hw.count, hw.devices_per_node) == (4, 2)
    assert hw.link(2).bandwidth == 1e11 and hw.link(4).bandwidth == 1e10
    assert hw.host_device == hw.intra_node  # defaults to the intra-node link
    with pytest.raises(HardwareError, match="no FLOP/s for dtype 'fp8'"):
        hw.device.peak("fp8")


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"device": {"flops": {"bf16": 1e14}, "memory_bytes": 1e9}}, "memory_bandwidth"),
        ({"device": {"flops": {}, "memory_bytes": 1, "memory_bandwidth": 1}}, "flops"),
        ({"device": {"flops": {"bf16": -1}, "memory_bytes": 1, "memory_bandwidth": 1}}, "bf16"),
        ({"gpus": 3}, "gpus"),
    ],
)
def test_a_bad_hardware_file_is_refused_naming_the_field(
    tmp_path: Path, data: dict[str, object], field: str
) -> None:
    data.setdefault("intra_node", {"bandwidth": 1e9})
    f = tmp_path / "hw.json"
    f.write_text(json.dumps(data))
    with pytest.raises(HardwareError, match=field):
        hardware.load(str(f))


def test_llama3_8b_shape_from_its_config() -> None:
    m = model_desc.load(LLAMA3_8B)
    assert (m.layers, m.hidden, m.heads, m.kv_heads, m.ffn) == (32, 4096, 32, 8, 14336)
    assert m.head_dim == 128 and m.dtype_bytes == 2
    # 32 · (2·4096² + 2·4096·1024 + 3·4096·14336) + 128256·4096 (LM head)
    assert m.params() == 32 * 218_103_808 + 525_336_576
    assert m.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2  # 128 KiB per token


def test_an_explicit_head_dim_is_the_attentions_width() -> None:
    """Qwen3-8B's config: 32 heads of 128 over hidden 4096 but Qwen3-0.6B's are 16 heads of 128
    over hidden 1024, so hidden / heads (64) would halve its KV and q/o projections."""
    cfg = json.loads(LLAMA3_8B.read_text()) | {
        "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "intermediate_size": 3072, "num_hidden_layers": 28,
    }  # fmt: skip
    m = model_desc.from_config(cfg)
    assert (m.head_dim, m.q_dim) == (128, 2048)
    assert m.kv_bytes_per_token() == 2 * 28 * 8 * 128 * 2
    # q, o: 1024·2048 each; k, v: 1024·1024 each; gate, up, down: 1024·3072 each
    assert m.layer_params() == 2 * 1024 * 2048 + 2 * 1024 * 1024 + 3 * 1024 * 3072
    plain = model_desc.from_config({k: v for k, v in cfg.items() if k != "head_dim"})
    assert (plain.head_dim, plain.q_dim) == (64, 1024)
    odd = cfg | {"hidden_size": 1000}  # 16 heads do not divide it: fine with head_dim given
    assert model_desc.from_config(odd).head_dim == 128
    with pytest.raises(ModelDescError, match="head_dim"):
        model_desc.from_config({k: v for k, v in odd.items() if k != "head_dim"})
    with pytest.raises(ModelDescError, match="head_dim must be a positive integer"):
        model_desc.from_config(cfg | {"head_dim": -1})


def test_a_bad_config_is_refused_naming_the_field(tmp_path: Path) -> None:
    cfg = json.loads(LLAMA3_8B.read_text())
    del cfg["intermediate_size"]
    with pytest.raises(ModelDescError, match="intermediate_size"):
        model_desc.from_config(cfg)
    cfg = json.loads(LLAMA3_8B.read_text()) | {"num_key_value_heads": 5}
    with pytest.raises(ModelDescError, match="kv heads"):
        model_desc.from_config(cfg)
    with pytest.raises(ModelDescError, match="--model"):
        model_desc.load(tmp_path / "missing")


def test_importing_them_does_not_import_torch() -> None:
    code = (
        "import sys; import gearshift.operator.sim.hardware, gearshift.operator.sim.model_desc;"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_example_in_docs_planning_loads() -> None:
    import re

    import yaml

    doc = (Path(__file__).parents[2] / "docs" / "planning.md").read_text(encoding="utf-8")
    match = re.search(r"```yaml\n(.*?)```", doc, re.S)
    assert match is not None
    hw = hardware.from_dict(yaml.safe_load(match.group(1)))
    assert (hw.count, hw.devices_per_node, hw.link(16).bandwidth) == (16, 8, 5e10)


def test_pcie_and_nvl_cards_are_presets_of_their_own_with_their_bridges() -> None:
    # Issue 30, item 6: datasheet figures (hardware.py cites them), dense.
    pcie, nvl, h200nvl = (hardware.preset(f"8x{n}") for n in ("H100PCIE", "H100NVL", "H200NVL"))
    assert pcie.device.memory_bandwidth == 2.0e12 and pcie.device.memory_bytes == 80e9
    assert nvl.device.memory_bytes == 94e9 and nvl.device.memory_bandwidth == 3.9e12
    assert h200nvl.device.memory_bytes == 141e9
    assert (
        pcie.device.peak("bf16")
        < nvl.device.peak("bf16")
        < hardware.preset("H100").device.peak("bf16")
    )
    # A 2-GPU NVLink bridge pairs H100 PCIe/NVL cards; H200 NVL bridges up to 4; beyond, PCIe.
    assert pcie.link(2).bandwidth == 300e9 and pcie.link(4).bandwidth == 64e9
    assert h200nvl.link(4).bandwidth == 450e9 and h200nvl.link(8).bandwidth == 64e9
    assert hardware.preset("8xH200").link(8).bandwidth == 450e9  # SXM: NVSwitch for all 8


@pytest.mark.parametrize(
    ("label", "preset"),
    [
        ("NVIDIA-H100-80GB-HBM3", "H100"),
        ("NVIDIA-H100-PCIe", "H100PCIE"),
        ("NVIDIA-H100-NVL", "H100NVL"),
        ("NVIDIA-H200", "H200"),
        ("NVIDIA-H200-NVL", "H200NVL"),
        ("NVIDIA-L4", "L4"),
        ("NVIDIA-L40S", None),
        ("NVIDIA-H200-PCIe", None),  # no such card: not taken for the SXM one
    ],
)
def test_the_node_label_map_keeps_pcie_and_nvl_cards_apart(label: str, preset: str | None) -> None:
    from gearshift.operator.reconcile import auto

    assert hardware.preset_of_product(label) == preset
    node = {"metadata": {"name": "n", "labels": {auto.GPU_LABEL: label}}}
    if preset is None:
        with pytest.raises(ValueError, match="not a device the planner describes"):
            auto.gpu_from_nodes([node], {})
    else:
        assert auto.gpu_from_nodes([node], {}) == preset
