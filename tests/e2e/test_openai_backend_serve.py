"""A router whose openai-http group is another `gearshift serve` (SmolLM2): its answers through
the router equal the backend's own (greedy; completions and chat; whole and streamed)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e import openai_compare
from tests.e2e.serve_process import ServeProcess


@pytest.fixture(scope="module")
def backend(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    proc = ServeProcess(
        tmp_path_factory.mktemp("backend"),
        "--model",
        "smollm2",
        "--served-model-name",
        "smollm2-backend",
        "--dtype",
        "bfloat16",
        "--max-num-seqs",
        "4",
        "--max-model-len",
        "1024",
        "--kv-cache-bytes",
        str(32 << 20),
    )
    with proc:
        yield proc
    assert proc.survivors() == []


def test_answers_through_the_router_equal_the_backends_own(backend: ServeProcess) -> None:
    metrics = openai_compare.run(backend.url, "smollm2-backend", 1024)
    assert openai_compare.success_count(metrics) == 2 * len(openai_compare.CASES)
    assert "gearshift_time_to_first_token_seconds_count" in metrics
