"""SiDP against its plain-DP baseline on the same code path (fp32, gloo, real processes).

The baseline (``PlainDpPolicy``: dp replicas each holding every weight) gives the one-process
engine's greedy tokens and runs its decode steps in the fused decode op, as SiDP WaS now does;
the KV capacity each holds is measured by admitting sequences until the first preemption, and
SiDP's is at least what its formula promises, and above plain DP's at the same per-rank memory.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gearshift.worker.config import EngineConfig
from gearshift.worker.engine.loading import inspect_model
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.kv.cache import KVCacheSpec
from gearshift.worker.launch import start_engine
from gearshift.worker.launch.group_config import GroupConfig
from gearshift.worker.launch.kv_probe import measure_kv_capacity
from gearshift.worker.launch.replicas import ReplicaGroup, start_replicas
from gearshift.worker.policies.base import Policy
from gearshift.worker.policies.registry import make_policy
from gearshift.worker.policies.sidp.ownership import Ownership, weight_bytes
from gearshift.worker.policies.sidp.plain_dp import PlainDpPolicy
from gearshift.worker.policies.sidp.shared_weights import segments
from gearshift.worker.sampling.params import SamplingParams

ENGINE: dict[str, Any] = {
    "dtype": "float32",
    "kv_cache_bytes": 64 << 10,
    "skip_tokenizer_init": True,
    "block_size": 4,
    "max_model_len": 64,
    "max_num_seqs": 256,
    "max_num_batched_tokens": 1024,
}


def _plain(dp: int) -> Policy:
    return PlainDpPolicy(make_policy({"sidp": {"dp": dp, "mode": "WAS"}}).to_proto(), dp)


@pytest.fixture
def groups() -> Iterator[Callable[[Path, Policy], ReplicaGroup]]:
    started: list[ReplicaGroup] = []

    def start(folder: Path, policy: Policy) -> ReplicaGroup:
        config = EngineConfig(model=str(folder), **ENGINE)
        handle = start_replicas(config, policy, GroupConfig(timeout_s=120))
        started.append(handle)
        return handle

    yield start
    for handle in started:
        if not handle._closed:
            reports = handle.shutdown()
            assert all(r["leaked_blocks"] == 0 and r["all_free"] for r in reports), reports
        assert all(not p.is_alive() for p in handle.procs)
    # Only this test's: another test's group may run beside it (pytest-xdist workers).
    mine = [os.getpid(), *(p.pid for h in started for p in h.procs)]
    assert segments(pids=mine) == [], "shared-memory segments left behind"


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 128, (k,), generator=g).tolist() for k in [3, 9, 6, 13][:n]]


@pytest.mark.parametrize("kind", ["plain", "WAS", "CAS"])
def test_decode_steps_run_the_fused_op_in_plain_dp_and_was_with_exact_tokens(
    tiny_checkpoint, groups, kind: str
) -> None:
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=4)
    prompts = _prompts(4)
    engine = start_engine(EngineConfig(model=str(folder), **ENGINE))
    try:
        want = [o.token_ids for o in engine.generate(prompts, _greedy(8))]
    finally:
        engine.shutdown()
    policy = _plain(2) if kind == "plain" else make_policy({"sidp": {"dp": 2, "mode": kind}})
    group = groups(folder, policy)
    work = {r: [(f"{r}-{i}", p, _greedy(8)) for i, p in enumerate(prompts)] for r in range(2)}
    results = group.generate(work)
    for r in range(2):
        assert [results[f"{r}-{i}"][0] for i in range(len(prompts))] == want
    fused = [group.stats(r)["policy"]["sidp_fused_layers"] for r in range(2)]
    if kind == "CAS":
        assert fused == [0.0, 0.0]  # rows cross to the owner between attention and FFN
    else:
        # 7 decode steps of 4 layers per replica (prefill steps run the Python layers).
        assert all(f >= 7 * 4 for f in fused), fused


def test_plain_dp_holds_every_weight_and_refuses_modes(tiny_checkpoint, groups) -> None:
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=4)
    spec, source = inspect_model(EngineConfig(model=str(folder), **ENGINE), torch.device("cpu"))
    source.close()
    group = groups(folder, _plain(2))
    full = weight_bytes(spec.config, Ownership(1, 4), 0, 0, 4).resident
    assert [group.stats(r)["policy"]["sidp_resident_weight_bytes"] for r in range(2)] == [full] * 2
    with pytest.raises(InvalidRequestError, match=r"policy\.sidp\.mode"):
        PlainDpPolicy(make_policy({"sidp": {"dp": 2, "mode": "AUTO"}}).to_proto(), 2)


@pytest.mark.parametrize(("dp", "layers"), [(2, 4), (3, 6)])
def test_measured_kv_capacity_is_at_least_the_formula_and_above_plain_dp(
    tiny_checkpoint, groups, dp: int, layers: int
) -> None:
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=layers)
    spec, source = inspect_model(EngineConfig(model=str(folder), **ENGINE), torch.device("cpu"))
    source.close()
    cfg = spec.config
    kv = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4, torch.float32)
    budget = ENGINE["kv_cache_bytes"]
    measured = {}
    for name, policy in (("plain", _plain(dp)), ("sidp", make_policy({"sidp": {"dp": dp}}))):
        group = groups(folder, policy)
        # The last replica owns the fewest layers when dp does not divide evenly: probe it.
        probe = measure_kv_capacity(group, dp - 1, 4, cfg.vocab_size, ENGINE["max_num_seqs"])
        group.shutdown()
        assert any(preempted for _, _, preempted in probe.probes), "capacity never reached"
        measured[name] = probe.tokens
    freed = weight_bytes(cfg, Ownership(dp, layers), dp - 1, dp - 1, 4).freed(layers)
    assert freed > 0
    formula = {
        "plain": kv.blocks_for_bytes(budget) * 4,
        "sidp": kv.blocks_for_bytes(budget + freed) * 4,
    }
    assert measured["sidp"] >= formula["sidp"], (measured, formula)
    assert measured["plain"] >= formula["plain"], (measured, formula)
    # Equal per-rank memory (weights + KV): SiDP's freed FFN bytes hold more tokens.
    assert measured["sidp"] > measured["plain"], measured
