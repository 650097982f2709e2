"""A router whose openai-http group is another `gearshift serve` (SmolLM2): its answers through
the router equal the backend's own (greedy; completions and chat; whole and streamed)."""

from __future__ import annotations

from tests.e2e import openai_compare
from tests.e2e.serve_process import ServeProcess


def test_answers_through_the_router_equal_the_backends_own(
    openai_backend: ServeProcess,
) -> None:
    metrics = openai_compare.run(openai_backend.url, "smollm2-backend", 1024)
    assert openai_compare.success_count(metrics) == 2 * len(openai_compare.CASES)
    assert "gearshift_time_to_first_token_seconds_count" in metrics
