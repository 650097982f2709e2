"""Which attention core runs: ``auto`` takes Triton on CUDA and stays as it was on CPU; ``triton``
on a CPU runs only under Triton's interpreter and is refused otherwise, by ``generate``,
``serve`` and ``worker`` before anything starts, with a message naming the flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gearshift.operator import cli
from gearshift.worker.attention.select import make_attention
from gearshift.worker.attention.torch_ref import TorchAttention
from gearshift.worker.attention.triton_backend import TritonAttention
from gearshift.worker.config import EngineConfig
from gearshift.worker.errors import InvalidRequestError

pytest.importorskip("triton")


@pytest.fixture
def no_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_auto_takes_triton_on_cuda_and_torch_stays_selectable(no_interpreter):
    # Built on a machine without a GPU: choosing a core launches nothing.
    assert isinstance(make_attention(EngineConfig(model="m", device="cuda"), 64), TritonAttention)
    core = make_attention(EngineConfig(model="m", device="cuda:0", attention_backend="triton"), 64)
    assert isinstance(core, TritonAttention)
    torch_core = make_attention(
        EngineConfig(model="m", device="cuda", attention_backend="torch"), 64
    )
    assert isinstance(torch_core, TorchAttention)


def test_auto_on_cpu_never_takes_triton_even_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not isinstance(make_attention(EngineConfig(model="m"), 64), TritonAttention)
    core = make_attention(EngineConfig(model="m", attention_backend="triton"), 64)
    assert isinstance(core, TritonAttention)


def test_triton_on_cpu_without_the_interpreter_is_refused_naming_the_flag(no_interpreter):
    with pytest.raises(InvalidRequestError) as refused:
        EngineConfig(model="m", attention_backend="triton")
    assert refused.value.field == "attention_backend"
    assert "--attention-backend" in refused.value.message
    assert "TRITON_INTERPRET=1" in refused.value.message


def test_triton_on_a_device_that_is_neither_cuda_nor_cpu_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(InvalidRequestError, match="needs a CUDA device"):
        EngineConfig(model="m", device="mps", attention_backend="triton")


def test_an_unknown_backend_is_refused_with_the_choices():
    with pytest.raises(InvalidRequestError, match="auto, torch, cpu, triton") as refused:
        EngineConfig(model="m", attention_backend="flash")
    assert refused.value.field == "attention_backend"


@pytest.mark.parametrize("backend", ["triton", "flash"])
def test_generate_refuses_before_loading_the_model(backend, no_interpreter, capsys):
    # The model does not exist: a refusal that came after loading would name it instead.
    argv = ["generate", "--model", "/nonexistent", "--prompt", "hi", "--attention-backend", backend]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "attention_backend" in err and "/nonexistent" not in err


@pytest.mark.parametrize("backend", ["triton", "flash"])
def test_serve_refuses_before_any_group_starts(backend, no_interpreter, capsys):
    argv = ["serve", "--model", "/nonexistent", "--port", "0", "--attention-backend", backend]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "attention_backend" in err


def test_worker_refuses_the_flag_and_the_engine_json_field(no_interpreter, tmp_path, capsys):
    argv = ["worker", "--model", "/nonexistent", "--port", "0", "--attention-backend", "triton"]
    assert cli.main(argv) == 2
    assert "--attention-backend" in capsys.readouterr().err
    config = Path(tmp_path / "engine.json")
    config.write_text(json.dumps({"model": {"path": "/nonexistent", "attentionBackend": "flash"}}))
    assert cli.main(["worker", "--config", str(config), "--port", "0"]) == 2
    assert "'flash' is not one of" in capsys.readouterr().err


def test_worker_settings_carry_the_backend_from_engine_json_unless_the_flag_says(tmp_path):
    from gearshift.worker.server.settings import load_settings

    config = tmp_path / "engine.json"
    config.write_text(json.dumps({"model": {"path": "/m", "attentionBackend": "torch"}}))
    parser = cli.build_parser()
    args = parser.parse_args(["worker", "--insecure-no-auth", "--config", str(config)])
    assert load_settings(args, env={}).engine.attention_backend == "torch"
    args = parser.parse_args(
        ["worker", "--insecure-no-auth", "--config", str(config), "--attention-backend", "cpu"]
    )
    assert load_settings(args, env={}).engine.attention_backend == "cpu"
    args = parser.parse_args(["worker", "--insecure-no-auth", "--model", "/m"])
    assert load_settings(args, env={}).engine.attention_backend == "auto"


def test_importing_gearshift_and_choosing_a_core_never_imports_triton():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import gearshift.operator.cli, gearshift.worker.launch, gearshift.worker.server.app\n"
        "from gearshift.worker.attention.select import make_attention\n"
        "from gearshift.worker.config import EngineConfig\n"
        "make_attention(EngineConfig(model='m', device='cuda'), 64)\n"
        "assert 'triton' not in sys.modules, sorted(m for m in sys.modules if 'triton' in m)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert res.returncode == 0, res.stderr
