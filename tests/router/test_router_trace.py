"""`--record-trace`: the real router writes each finished request's arrival and lengths, and the
simulator's loader replays them; an unwritable path is refused at start."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from gearshift.operator.router import config as config_mod
from gearshift.operator.router.config import RouterConfig
from gearshift.operator.router.server import RouterServer, load_tokenizer
from gearshift.operator.sim import trace
from gearshift.v1 import common_pb2
from gearshift.worker.tokenizer import Tokenizer
from tests.router.fake_worker import Script
from tests.router.test_router_routing import Setup, run


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer("smollm2")


def test_finished_requests_are_recorded_and_replay_in_arrival_order(
    tokenizer: Tokenizer, tmp_path: Path
) -> None:
    path = tmp_path / "trace.jsonl"

    async def scenario(s: Setup) -> None:
        for w in s.workers:
            w.script = Script(tokens=[42, 43, 44], finish=common_pb2.FINISH_REASON_STOP)
        r = await s.http.post("/v1/completions", json={"prompt": [1, 2, 3, 4, 5]})
        assert r.is_success
        await asyncio.sleep(0.2)
        for w in s.workers:
            w.script = Script(tokens=[7] * 6)
        r = await s.http.post(
            "/v1/completions", json={"prompt": [9, 9], "max_tokens": 6, "stream": True}
        )
        assert r.is_success

    run(tokenizer, scenario, record_trace=path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["prompt_tokens"], r["output_tokens"], r["finish_reason"]) for r in rows] == [
        (5, 3, "stop"),
        (2, 6, "length"),
    ]
    assert rows[1]["arrival_s"] - rows[0]["arrival_s"] >= 0.2
    replay = trace.load(path)
    assert [(r.prompt_tokens, r.output_tokens) for r in replay] == [(5, 3), (2, 6)]
    assert replay[0].arrival_s == 0.0 and replay[1].arrival_s >= 0.2


def test_an_unwritable_trace_path_is_refused_at_start(tokenizer: Tokenizer, tmp_path: Path) -> None:
    cfg = RouterConfig(
        model_name="fake",
        model_path="smollm2",
        host="127.0.0.1",
        http_port=0,
        grpc_port=None,
        admin_port=None,
        record_trace=tmp_path / "missing" / "t.jsonl",
        insecure_no_auth=True,  # no groups to call here
    )

    async def main() -> None:
        server = RouterServer(cfg, tokenizer=tokenizer)
        try:
            with pytest.raises(config_mod.ConfigError, match="--record-trace"):
                await server.start()
        finally:
            await server.stop(drain_timeout_s=1)

    asyncio.run(main())
