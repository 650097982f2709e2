"""`gearshift serve --policy-config` (the CRD's spec.policy) for every policy the engine runs:
the openai client gets one rank's greedy text from TP 2 x PP 2 (static.yaml's layout), from
the shift policy, from seesaw (P2 -> T2) and from sidp (2 replicas of TP 2), on a random model
that speaks SmolLM2's vocabulary."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gearshift.v1 import policy_pb2, router_pb2, router_pb2_grpc
from tests.e2e.serve_process import ServeProcess
from tests.worker.helpers import random_model_with_smollm2_tokenizer

CHATS = ["What is the capital of France?", "Count to five."]
# tetris.yaml's pool and TP decode instance, smaller: 2 prefill instances and one TP-2 decode
# instance (4 CPU ranks); chunks of 8 tokens and Eq. (1) models for SP 1 and 2 so the router's
# planner cuts the chat prompts into chunks on growing groups.
TETRIS = (
    '{"tetris": {"prefillInstances": 2, "decodeInstances": 1, "decodeTp": 2, '
    '"chunkGranularity": 8, "improvementRate": 0.0, "latencyModels": ['
    '{"sp": 1, "a": 0.001, "b": 0.002, "c": 1e-6, "d": 1e-5}, '
    '{"sp": 2, "a": 0.002, "b": 0.001, "c": 5e-7, "d": 5e-6}]}}'
)
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
        # sidp.yaml's replicas of TP 2 (two of them, not four: 4 CPU ranks).
        '{"sidp": {"dp": 2, "tp": 2}}',
        TETRIS,
    ],
    ids=["static-tp2pp2", "shift-sp2-yaml", "seesaw-p2-t2", "sidp-dp2-tp2", "tetris-p2-d1tp2"],
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
    # `gearshift serve` (the router's process) checked the policy and served the chats without
    # loading torch: only its workers run a model.
    assert proc.proc is not None
    maps = Path(f"/proc/{proc.proc.pid}/maps").read_text()
    assert "libtorch" not in maps, "the serve process loaded torch"
    if policy.startswith('{"seesaw"'):
        _seesaw_thresholds_apply_live(proc)
    if policy.startswith('{"sidp"'):
        _sidp_group_runs_as_asked(proc)
    if policy.startswith('{"tetris"'):
        _tetris_group_ran_the_plans(proc)


def _sidp_group_runs_as_asked(proc: ServeProcess) -> None:
    """The served group is the layout asked: 2 replicas of 2 TP ranks, each holding FFN shards."""
    with grpc.insecure_channel(proc.admin_address) as channel:
        groups = (
            router_pb2_grpc.AdminStub(channel)
            .GetStatus(router_pb2.GetStatusRequest(), timeout=10, metadata=proc.metadata)
            .groups
        )
    sidp = groups[0].policy.sidp
    assert (sidp.dp, sidp.tp) == (2, 2)
    stats = dict(groups[0].stats.policy_stats)
    assert stats["replica0_sidp_resident_weight_bytes"] > 0, stats
    assert stats["replica1_sidp_resident_weight_bytes"] > 0, stats


def _tetris_group_ran_the_plans(proc: ServeProcess) -> None:
    """The router planned each request (its metrics) and the group ran the plans on its pool
    and handed the KV over through the handshake (its stats and instances)."""
    import httpx

    metrics = httpx.get(f"{proc.url}/metrics", timeout=10).text
    counts = [
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("gearshift_tetris_plan_chunks_count")
    ]
    assert counts and sum(counts) == len(CHATS), metrics
    sp = [
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("gearshift_tetris_chunk_sp_size_sum")
    ]
    chunks = [
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("gearshift_tetris_plan_chunks_sum")
    ]
    # Every chunk ran on a ring of at least one instance; the pool's two instances bound it.
    assert chunks and len(CHATS) <= chunks[0] <= sp[0] <= 2 * chunks[0], (chunks, sp)
    # The router shows the stats of its last poll of the worker, which may predate the last
    # request: wait (bounded) for a poll that follows it.
    deadline = time.monotonic() + 30
    while True:
        with grpc.insecure_channel(proc.admin_address) as channel:
            groups = (
                router_pb2_grpc.AdminStub(channel)
                .GetStatus(router_pb2.GetStatusRequest(), timeout=10, metadata=proc.metadata)
                .groups
            )
        stats = dict(groups[0].stats.policy_stats)
        if stats.get("prefills") == len(CHATS) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert stats["prefills"] == len(CHATS), stats
    assert stats["transfer_waits"] >= len(CHATS), stats
    roles = sorted((i.role, i.index) for i in groups[0].stats.instances)
    assert len(roles) == 3, roles
    _tetris_profile_of_the_running_pool(proc)


def _tetris_profile_of_the_running_pool(proc: ServeProcess) -> None:
    """`gearshift tetris-profile --worker` measures the served group's own pool (Worker.
    ProfileTetris) and prints Eq. (1) models per SP size; without the token it is refused."""
    import json
    import subprocess
    import sys

    address = proc.info["groups"][0]["address"]
    command = [sys.executable, "-m", "gearshift.operator.cli", "tetris-profile"]
    grid = ["--worker", address, "--lengths", "4,8,12", "--histories", "0,8", "--timeout", "120"]
    done = subprocess.run(
        [*command, *grid, "--token-file", proc.info["control_token_file"]],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert [m["sp"] for m in report["latencyModels"]] == [1, 2], report
    assert all(
        len(rows) == 6 and all(r[2] > 0 for r in rows) for rows in report["samples"].values()
    )
    refused = subprocess.run(
        [*command, *grid], capture_output=True, text=True, timeout=60, check=False
    )
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr, refused.stderr


def _apply(proc: ServeProcess, **fields: float) -> router_pb2.AdminApplyPolicyResponse:
    policy = policy_pb2.Policy(seesaw=policy_pb2.SeesawPolicy(**fields))
    with grpc.insecure_channel(proc.admin_address) as channel:
        return router_pb2_grpc.AdminStub(channel).ApplyPolicy(
            router_pb2.AdminApplyPolicyRequest(policy=policy), timeout=30, metadata=proc.metadata
        )


def _seesaw_thresholds_apply_live(proc: ServeProcess) -> None:
    """Seesaw's live parameters through the real Admin API: applied, shown by the group, and a
    value the policy refuses changes nothing."""
    done = _apply(proc, switch_to_decode_at_host_usage=0.5, switch_to_prefill_at_host_usage=0.25)
    assert done.applied, done
    live = done.results[0].policy.seesaw
    assert (live.switch_to_decode_at_host_usage, live.switch_to_prefill_at_host_usage) == (
        0.5,
        0.25,
    )
    refused = _apply(proc, switch_to_prefill_at_host_usage=0.75)  # above the decode threshold
    assert not refused.applied
    assert "switchToPrefillAtHostUsage must be below" in refused.results[0].message, refused
    with grpc.insecure_channel(proc.admin_address) as channel:
        status = router_pb2_grpc.AdminStub(channel).GetStatus(
            router_pb2.GetStatusRequest(), timeout=10, metadata=proc.metadata
        )
    assert status.groups[0].policy.seesaw.switch_to_prefill_at_host_usage == 0.25
