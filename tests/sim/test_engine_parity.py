"""The simulator and the engine share the scheduler: one trace through the real engine (a tiny
random model on CPU) and through the simulator gives every request its tokens at the same steps,
preemptions included; and a profile of the engine predicts its wall time (loosely: the CPU is
shared, the benchmark reports the real error)."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gearshift.operator.sim.cost_model import LinearFit, StepCostModel
from gearshift.operator.sim.profile import ProfileGrid, measure
from gearshift.operator.sim.replica import ReplicaConfig
from gearshift.operator.sim.simulator import Deployment, simulate
from gearshift.operator.sim.trace import TraceRequest
from gearshift.worker.config import EngineConfig
from gearshift.worker.engine.llm_engine import LLMEngine
from gearshift.worker.launch import build_local_engine, start_engine
from gearshift.worker.sampling.params import SamplingParams
from tests.worker.helpers import make_hf_checkpoint

# One second per step: simulated token times are then step numbers.
UNIT = StepCostModel(LinearFit(1.0, 0.0, 0.0), LinearFit(1.0, 0.0, 0.0))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("tiny"), hidden=64, layers=2, vocab=128)


@pytest.fixture
def engine_of(checkpoint: Path) -> Iterator[Callable[..., LLMEngine]]:
    engines: list[LLMEngine] = []

    def make(policy: dict[str, Any] | None = None, **kw: Any) -> LLMEngine:
        config = EngineConfig(
            model=str(checkpoint),
            dtype="float32",
            enable_prefix_caching=False,
            skip_tokenizer_init=True,
            **kw,
        )
        engine = build_local_engine(config) if policy is None else start_engine(config, policy)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        assert engine.blocks.leaked_blocks() == []
        engine.shutdown()


def _trace(n: int, seed: int) -> list[TraceRequest]:
    rng = random.Random(seed)
    return [TraceRequest(0.0, rng.randint(5, 120), rng.randint(1, 30)) for _ in range(n)]


def _run_engine(engine: LLMEngine, trace: list[TraceRequest]) -> list[list[int]]:
    """Each request's token step numbers (1-based) in the real engine."""
    steps: list[list[int]] = [[] for _ in trace]
    for i, r in enumerate(trace):
        params = SamplingParams(temperature=0.0, max_tokens=r.output_tokens, ignore_eos=True)
        engine.add_request(f"r{i}", [(i * 7 + k) % 128 for k in range(r.prompt_tokens)], params)
    step = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        step += 1
        for out in outputs:
            steps[int(out.request_id[1:])].extend([step] * len(out.new_token_ids))
    return steps


@pytest.mark.parametrize(
    ("kv_blocks", "budget"), [(None, 64), (12, 48)], ids=["roomy", "kv-pressure"]
)
def test_engine_and_simulator_give_tokens_at_the_same_steps(
    engine_of: Callable[..., LLMEngine], kv_blocks: int | None, budget: int
) -> None:
    # A block of the tiny model: K and V × 2 layers × 2 KV heads × 16 tokens × head 8 × fp32.
    kv: dict[str, int] = {}
    if kv_blocks is not None:
        kv = {"kv_cache_bytes": kv_blocks * 2 * 2 * 2 * 16 * 8 * 4, "max_model_len": 160}
    engine = engine_of(max_num_batched_tokens=budget, block_size=16, max_num_seqs=8, **kv)
    if kv_blocks is not None:
        assert engine.blocks.num_blocks == kv_blocks
    trace = _trace(14, seed=4)
    real = _run_engine(engine, trace)
    sim = simulate(Deployment(1, ReplicaConfig.of_engine(engine), UNIT), trace)
    simulated = [[round(t) for t in r.token_times] for r in sim.requests]
    assert simulated == real
    assert (sim.preemptions > 0) == (engine.scheduler.num_preemptions > 0)
    if kv_blocks is not None:
        assert engine.scheduler.num_preemptions > 0, "the pressure case must preempt"
        assert sim.preemptions == engine.scheduler.num_preemptions


def _finish_order(times: list[list[float]]) -> list[list[int]]:
    """Token times as the engine counts steps: the n-th step that ends (one per ``step()``)."""
    order = {t: k + 1 for k, t in enumerate(sorted({t for r in times for t in r}))}
    return [[order[t] for t in r] for r in times]


@pytest.mark.slow
def test_a_pipeline_keeps_the_engines_micro_batches_in_flight(
    engine_of: Callable[..., LLMEngine],
) -> None:
    # PP 2 (two gloo ranks): two micro-batches over disjoint sequences are in flight, each
    # taking half of the active requests (the static policy's step_request, run as is).
    engine = engine_of({"static": {"pp": 2}}, max_num_batched_tokens=64, block_size=16)
    assert engine.policy.micro_batches() == 2
    trace = _trace(10, seed=7)
    real = _run_engine(engine, trace)
    deployment = Deployment(
        1,
        ReplicaConfig.of_engine(engine),
        UNIT,
        engine.policy.step_request,
        micro_batches=2,
        stages=2,
    )
    sim = simulate(deployment, trace)
    assert _finish_order([r.token_times for r in sim.requests]) == real
    # Pipelining shows in simulated time: with both stages busy a micro-batch ends every half
    # step, so the run takes fewer step-units than it has steps.
    assert sim.makespan < sum(sim.steps) * 0.75
    alone = simulate(
        Deployment(1, ReplicaConfig.of_engine(engine), UNIT, engine.policy.step_request), trace
    )
    assert sim.makespan < alone.makespan
    # The profile times lone micro-batches (each a whole trip through both stages), batches of
    # several requests included, and leaves the pipeline as it was.
    grid = ProfileGrid((8, 32), (1, 2), (1, 4), (16,), decode_steps=3, repeats=1)
    profile = measure(engine, grid)
    assert max(t for t, _, _ in profile.decode) == 4 and max(t for t, _, _ in profile.prefill) == 64
    assert engine.policy.micro_batches() == 2


def test_a_profile_reads_each_steps_features_as_scheduled(
    engine_of: Callable[..., LLMEngine],
) -> None:
    # A fresh prompt of n tokens attends n(n + 1)/2 positions in its step, as the simulator
    # prices it; read after the step, its tokens would count as context too (3n²/2).
    engine = engine_of(max_num_batched_tokens=128, block_size=16)
    grid = ProfileGrid((8, 32), (1, 2), (1, 3), (16,), decode_steps=2, repeats=1)
    profile = measure(engine, grid)
    # 4 prefill points, and the first step of each decode point (its prompts' prefill).
    assert profile.prefill_rows == [1, 2, 1, 2, 1, 3]
    for (tokens, attended, _), rows in zip(profile.prefill, profile.prefill_rows, strict=True):
        n = tokens / rows
        assert attended == rows * n * (n + 1) / 2
    # A decode row of a 16-token prompt with its first token (16 computed) attends 17.
    assert [(t, a) for t, a, _ in profile.decode] == [(1, 17.0), (3, 51.0)]
    # The profile leaves the scheduler as it found it: its own schedule, no wrapper recording
    # every step the engine serves afterwards.
    assert "schedule" not in vars(engine.scheduler)


@pytest.mark.serial
@pytest.mark.slow
def test_a_profile_predicts_the_engines_wall_time_within_a_loose_bound(
    engine_of: Callable[..., LLMEngine],
) -> None:
    # One thread: on a shared CPU, idle OpenMP threads waiting for busy cores turn 1 ms steps
    # into 100 ms ones at random, which no fit can predict.
    engine = engine_of(max_num_batched_tokens=256, block_size=16, num_threads=1)
    grid = ProfileGrid(
        prompt_lens=(8, 32, 96, 200),
        prefill_batches=(1, 2),
        decode_batches=(1, 4, 12),
        contexts=(16, 120),
        decode_steps=5,
        repeats=2,
    )
    model = measure(engine, grid).model({})
    trace = _trace(24, seed=5)
    start = time.perf_counter()
    _run_engine(engine, trace)
    measured = time.perf_counter() - start
    predicted = simulate(Deployment(1, ReplicaConfig.of_engine(engine), model), trace).makespan
    # Loose on purpose: four engineers share two cores (benchmarks/sim_fidelity.py reports it).
    assert predicted == pytest.approx(measured, rel=0.5)


@pytest.mark.slow
def test_gearshift_profile_writes_a_model_the_simulator_loads(
    checkpoint: Path, tmp_path: Path
) -> None:
    out = tmp_path / "cost.json"
    cmd = [sys.executable, "-m", "gearshift.operator.cli", "profile", "--model", str(checkpoint)]
    cmd += ["--dtype", "float32", "--num-threads", "1", "--quick", "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    model = StepCostModel.load(out)
    assert model.about["prefill_samples"] > 3 and model.about["decode_samples"] > 3
    assert model.about["policy"] == {"static": {}}
    res = simulate(Deployment(1, ReplicaConfig(num_blocks=64, block_size=16), model), _trace(5, 1))
    assert len(res.requests) == 5 and res.makespan > 0


def test_gearshift_profile_refuses_a_missing_model_naming_it(tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    cmd = [sys.executable, "-m", "gearshift.operator.cli", "profile", "--model", "/nonexistent/m"]
    done = subprocess.run([*cmd, "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "error: model '/nonexistent/m' not found" in done.stderr
    assert not out.exists()
