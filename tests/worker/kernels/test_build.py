"""Building, caching and falling back: the kernels are optional, the torch path always works."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gearshift.worker.kernels import build

ROOT = Path(__file__).resolve().parents[3]


def _run(code: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_cache_key_depends_on_the_compiler_and_is_stable(monkeypatch):
    key = build.build_key()
    assert build.build_key() == key
    monkeypatch.setenv("CXX", "/opt/other/c++")
    assert build.build_key() != key


@pytest.mark.slow
def test_env_switch_disables_the_kernels_without_building(tmp_path):
    cache = tmp_path / "cache"
    code = "from gearshift.worker import kernels; print(kernels.available())"
    done = _run(code, {"GEARSHIFT_CPU_KERNELS": "0", "GEARSHIFT_KERNEL_CACHE": str(cache)}, 120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
    assert not cache.exists()


@pytest.mark.slow
def test_missing_compiler_falls_back_to_torch_with_a_warning(tmp_path, tiny_checkpoint):
    # A whole engine in a fresh process: the build fails, the warning is logged, and greedy
    # generation still works through the torch reference path.
    folder = tiny_checkpoint("llama3-scaled")
    code = f"""
import logging
logging.basicConfig(level=logging.WARNING)
from gearshift.worker import kernels
from gearshift.worker.attention.select import make_attention
from gearshift.worker.config import EngineConfig
from gearshift.worker.launch import build_local_engine
from gearshift.worker.sampling.params import SamplingParams
config = EngineConfig(model={str(folder)!r}, dtype="float32", skip_tokenizer_init=True,
                      kv_cache_bytes=16 << 20)
print("available", kernels.available())
print("core", type(make_attention(config, 64)).__name__)
engine = build_local_engine(config)
out = engine.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=4))
print("tokens", len(out[0].token_ids))
engine.shutdown()
"""
    env = {
        "CXX": str(tmp_path / "no-such-compiler"),
        "GEARSHIFT_KERNEL_CACHE": str(tmp_path),
        "GEARSHIFT_CPU_KERNELS": "1",
    }
    done = _run(code, env, 300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "available False" in done.stdout
    assert "core TorchAttention" in done.stdout
    assert "tokens 4" in done.stdout
    assert "CPU kernels unavailable, using the torch reference path" in done.stderr
    assert not list(tmp_path.glob("*/*.so")), "a failed build must leave no library behind"
