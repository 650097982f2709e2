"""`gearshift serve --policy-config` (the CRD's spec.policy) for every policy the engine runs:
the openai client gets one rank's greedy text from TP 2 x PP 2 (static.yaml's layout), from
the shift policy and from seesaw (P2 -> T2), on a random model that speaks SmolLM2's vocabulary."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.serve_process import ServeProcess
from tests.worker.helpers import random_model_with_smollm2_tokenizer

CHATS = ["What is the capital of France?", "Count to five."]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gearshift.worker.model.registry import resolve_model_path

    folder = tmp_path_factory.mktemp("tp2pp2-model")
    return random_model_with_smollm2_tokenizer(folder, resolve_model_path("smollm2"))


@pytest.fixture(scope="module")
def one_rank_text(model: Path) -> list[str]:
    from gearshift.worker.config import EngineConfig
    from gearshift.worker.launch import build_local_engine
    from gearshift.worker.sampling.params import SamplingParams

    engine = build_local_engine(EngineConfig(model=str(model), dtype="float32"))
    try:
        tok = engine.tokenizer
        assert tok is not None
        prompts = [tok.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
        outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
        return [o.text for o in outs]
    finally:
        engine.shutdown()


@pytest.fixture
def serve_policy(model: Path, tmp_path: Path) -> Iterator[object]:
    procs: list[ServeProcess] = []

    def start(policy: str) -> ServeProcess:
        proc = ServeProcess(
            tmp_path,
            "--model",
            str(model),
            "--dtype",
            "float32",
            "--policy-config",
            policy,
            start_timeout=300,
        )
        procs.append(proc.__enter__())
        return proc

    yield start
    for proc in procs:
        assert proc.stop() == 0, proc.tail()
        assert proc.survivors() == []


@pytest.mark.slow
@pytest.mark.parametrize(
    "policy",
    [
        '{"static": {"tp": 2, "pp": 2}}',
        "shift:\n  sp: 2\n  threshold: 8\n",
        '{"seesaw": {"prefill": {"tp": 1, "pp": 2}, "decode": {"tp": 2, "pp": 1}, '
        '"hostKvCapacityBytes": 67108864}}',
    ],
    ids=["static-tp2pp2", "shift-sp2-yaml", "seesaw-p2-t2"],
)
def test_policy_config_serves_one_ranks_greedy_text(policy, serve_policy, one_rank_text):
    from openai import OpenAI

    proc = serve_policy(policy)
    client = OpenAI(base_url=f"{proc.url}/v1", api_key="none", timeout=120, max_retries=0)
    served = client.models.list().data[0].id
    got = []
    for chat in CHATS:
        reply = client.chat.completions.create(
            model=served,
            messages=[{"role": "user", "content": chat}],
            max_tokens=MAX_TOKENS,
            temperature=0.0,
        )
        got.append(reply.choices[0].message.content)
    assert got == one_rank_text
