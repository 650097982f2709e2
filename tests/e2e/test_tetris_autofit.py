"""A Tetris group served without latency models fits them itself (issue 29): before it serves,
it measures CDSP prefill on its own pool (the `tetris-profile` grid), fits Eq. (1) per SP size,
says so in its status (WorkerStats.tetris_models, through the router's Admin GetStatus), and the
router's next plan is Algorithm 1's on those fitted coefficients, at the improvement rate the
router profiled from them (no improvementRate in the policy), not the group's one-chunk
fallback. Real processes: `gearshift serve` with a 2-instance pool and a decode instance."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from gearshift.operator.planner.cdsp import PlannerRules, plan_request
from gearshift.operator.planner.improvement_rate import pick_improvement_rate
from gearshift.operator.planner.instance_pool import Pool
from gearshift.operator.planner.latency_model import LatencyModel
from gearshift.operator.router import tetris_rate_profile
from gearshift.v1 import router_pb2, router_pb2_grpc, worker_pb2
from tests.e2e.serve_process import ServeProcess
from tests.worker.helpers import random_model_with_smollm2_tokenizer

# No latencyModels: the group measures C + L up to 32 tokens (C in {0, 16}, L in {4, 8, 16}),
# twice per point, on SP 1 and 2. No improvementRate: the router profiles its table from the
# fitted models (tetris_rate_profile.py). 8-token chunks.
POLICY = (
    '{"tetris": {"prefillInstances": 2, "decodeInstances": 1, "chunkGranularity": 8, '
    '"autoProfileTokens": 32}}'
)
PROMPT = [7] * 40


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gearshift.worker.model.registry import resolve_model_path

    folder = tmp_path_factory.mktemp("autofit-model")
    return random_model_with_smollm2_tokenizer(folder, resolve_model_path("smollm2"))


@pytest.fixture
def served(model: Path, tmp_path: Path) -> Iterator[ServeProcess]:
    proc = ServeProcess(
        tmp_path,
        "--model",
        str(model),
        "--dtype",
        "float32",
        "--policy-config",
        POLICY,
        start_timeout=300,
    )
    with proc:
        yield proc
    assert proc.stop() == 0, proc.tail()
    assert proc.survivors() == []


def _status(proc: ServeProcess) -> router_pb2.GroupStatus:
    with grpc.insecure_channel(proc.admin_address) as channel:
        return (
            router_pb2_grpc.AdminStub(channel)
            .GetStatus(router_pb2.GetStatusRequest(), timeout=10, metadata=proc.metadata)
            .groups[0]
        )


def _metric(text: str, name: str) -> float:
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name)]
    assert len(values) == 1, (name, text)
    return values[0]


@pytest.mark.slow
def test_a_group_without_models_fits_them_at_start_and_the_router_plans_with_them(served):
    # The router polls the group; its first stats already carry the models (fitted before the
    # group served).
    deadline = time.monotonic() + 30
    group = _status(served)
    while not group.HasField("stats") and time.monotonic() < deadline:
        time.sleep(0.2)
        group = _status(served)
    fitted = group.stats.tetris_models
    assert fitted.source == worker_pb2.TetrisModelStatus.AUTO_FITTED, fitted
    assert [m.sp for m in fitted.models] == [1, 2], fitted
    assert fitted.samples == 2 * 2 * 3 * 2 and "fitted at start" in fitted.message, fitted
    assert not group.policy.tetris.latency_models  # the configured policy is left as it was
    assert sorted(fitted.fit_rms_error) == [1, 2]

    name = httpx.get(f"{served.url}/v1/models", timeout=10).json()["data"][0]["id"]
    r = httpx.post(
        f"{served.url}/v1/completions",
        json={"model": name, "prompt": PROMPT, "max_tokens": 2},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    metrics = httpx.get(f"{served.url}/metrics", timeout=10).text
    # The router planned the request (without models it sends no plan at all) ...
    assert _metric(metrics, "gearshift_tetris_plan_chunks_count") == 1.0
    # ... with the fitted coefficients: its estimate and SP sizes are Algorithm 1's on them,
    # over an idle pool of two instances on one node.
    rules = PlannerRules(
        {m.sp: LatencyModel(m.sp, m.a, m.b, m.c, m.d) for m in fitted.models}, 8, 4
    )
    # ... at the improvement rate the router profiled from them for this one prompt, the row of
    # one request per 30-s window.
    assert _metric(metrics, 'gearshift_tetris_improvement_rate_count{model_name="') == 1.0
    assert (
        'gearshift_tetris_improvement_rate_count{model_name="' + name + '",source="profiled"}'
        in metrics
    )
    rate = _metric(metrics, "gearshift_tetris_improvement_rate_sum")
    table = tetris_rate_profile.profile(rules, (0, 0), [len(PROMPT)])
    assert rate == pytest.approx(pick_improvement_rate(table, 1 / 30, 0.3), abs=1e-6), table
    want = plan_request(len(PROMPT), Pool({0: 0.0, 1: 0.0}, (0, 0)), rules, rate)
    estimate = _metric(metrics, "gearshift_tetris_planned_prefill_seconds_sum")
    assert estimate == pytest.approx(want.ttft, rel=1e-6), (want, fitted)
    sp_sum = _metric(metrics, "gearshift_tetris_chunk_sp_size_sum")
    assert sp_sum == sum(c.sp for c in want.chunks), want
    assert _metric(metrics, "gearshift_tetris_plan_chunks_sum") == len(want.chunks)
