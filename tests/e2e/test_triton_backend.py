"""`gearshift generate` and `gearshift serve` with `--attention-backend triton`, under Triton's
interpreter on CPU, give the torch backend's greedy text on a random model that speaks SmolLM2's
vocabulary; `serve` with several requests at once (prefill chunks mixed with decodes)."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.e2e.serve_process import ServeProcess
from tests.worker.helpers import random_model_with_smollm2_tokenizer

pytest.importorskip("triton")

PROMPTS = [
    "The capital of France is",
    "Count to five:",
    "Write a short poem about the sea and the wind over the harbour at night.",
    "1, 2, 3,",
]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gearshift.worker.model.registry import resolve_model_path

    folder = tmp_path_factory.mktemp("triton-model")
    return random_model_with_smollm2_tokenizer(folder, resolve_model_path("smollm2"), layers=2)


@pytest.fixture(scope="module")
def torch_runs(model: Path) -> tuple[list[list[int]], list[str]]:
    """Each prompt's token ids and the torch backend's greedy text, one engine in this process."""
    from gearshift.worker.config import EngineConfig
    from gearshift.worker.launch import build_local_engine
    from gearshift.worker.sampling.params import SamplingParams

    config = EngineConfig(model=str(model), dtype="float32", attention_backend="torch")
    engine = build_local_engine(config)
    try:
        assert engine.tokenizer is not None
        ids = [engine.tokenizer.encode(p) for p in PROMPTS]
        outs = engine.generate(ids, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
        return ids, [o.text for o in outs]
    finally:
        engine.shutdown()


def _interpreter_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEARSHIFT_")}
    return {**env, "TRITON_INTERPRET": "1"}


@pytest.mark.slow
def test_generate_with_triton_prints_the_torch_backends_text(model, torch_runs):
    _, texts = torch_runs
    # generate tokenises the text as the engine did for ids[0] (LLMEngine.add_request).
    argv = [sys.executable, "-m", "gearshift.operator.cli", "generate", "--model", str(model)]
    argv += ["--prompt", PROMPTS[0], "--max-tokens", str(MAX_TOKENS), "--dtype", "float32"]
    argv += ["--attention-backend", "triton", "--block-size", "16"]
    res = subprocess.run(
        argv, env=_interpreter_env(), capture_output=True, text=True, timeout=300, check=False
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout == texts[0] + "\n"


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy",
    [[], ["--policy", "shift", "--sp", "2", "--shift-threshold", "8"]],
    ids=["one-rank", "shift-sp2"],
)
def test_serve_with_triton_answers_concurrent_requests_with_the_torch_backends_text(
    policy, model, torch_runs, tmp_path, monkeypatch
):
    # shift-sp2: Ulysses (SP 2) wraps the triton core in the base gear, the shift gear runs it
    # on TP 2 shards of the heads; both see this step's KV in the one shared cache.
    from openai import OpenAI

    ids, texts = torch_runs
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # ServeProcess passes the environment on
    args = ["--model", str(model), "--dtype", "float32", "--attention-backend", "triton", *policy]
    # 16-token steps: the longer prompts prefill in chunks over their cached prefix while the
    # others decode.
    args += ["--max-num-batched-tokens", "16", "--block-size", "16"]
    with ServeProcess(tmp_path, *args, start_timeout=300) as proc:
        client = OpenAI(base_url=f"{proc.url}/v1", api_key="none", timeout=240, max_retries=0)
        served = client.models.list().data[0].id

        def complete(prompt: list[int]) -> str:
            reply = client.completions.create(
                model=served, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0
            )
            return reply.choices[0].text

        with ThreadPoolExecutor(len(ids)) as pool:
            got = list(pool.map(complete, ids, timeout=300))
        assert got == texts
        assert proc.stop() == 0, proc.tail()
        assert proc.survivors() == []
