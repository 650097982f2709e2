"""SiDP with tensor parallelism inside each replica: dp 2 × tp 2 (and dp 3 × tp 2, dp 2 × tp 4)
(fp32, gloo, real processes).

Every replica's greedy tokens equal the one-process engine's in WaS (each TP rank fetches its own
shard of the owner's layers), in CaS (TP rank t ships its rows to the owner's TP rank t) and
across group-wide switches mid-generation; each rank holds its formula's TP-sharded weights.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from gearshift.worker.config import EngineConfig
from gearshift.worker.engine.loading import inspect_model
from gearshift.worker.errors import GroupFailure, InvalidRequestError
from gearshift.worker.kv.cache import KVCacheSpec
from gearshift.worker.launch.group_config import GroupConfig
from gearshift.worker.policies.registry import make_policy
from gearshift.worker.policies.sidp.ffn import Mode
from gearshift.worker.policies.sidp.ownership import Ownership, weight_bytes
from gearshift.worker.policies.sidp.shared_weights import clean_stale, segments
from tests.worker.policies.test_sidp_replicas import (
    ENGINE,
    _assert_all_equal,
    _flip_modes,
    _prompts,
    _reference,
    _work,
    replica_factory,  # noqa: F401 - the fixture
)

SIDP = {"dp": 2, "tp": 2}


@pytest.mark.parametrize(
    ("dp", "tp", "layers", "mode"),
    [(2, 2, 4, "WAS"), (2, 2, 4, "CAS"), (3, 2, 5, "CAS"), (2, 4, 4, "WAS")],
)
def test_replicas_of_tp_ranks_match_the_reference(
    tiny_checkpoint,
    replica_factory,  # noqa: F811
    dp: int,
    tp: int,
    layers: int,
    mode: str,
) -> None:
    # tp 4 over 2 KV heads: each KV head replicated on two ranks of a replica.
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=layers)
    prompts = _prompts(4)
    want = dict(zip(map(tuple, prompts), _reference(folder, prompts, 8), strict=True))
    group = replica_factory(folder, {"dp": dp, "tp": tp, "mode": mode})
    assert group.replicas == dp and len(group.procs) == dp * tp
    work = _work(dp, prompts, 8)
    _assert_all_equal(group.generate(work), work, want)
    stats = [group.stats(r)["policy"] for r in range(dp)]
    if mode == "WAS":
        assert all(s["sidp_fetched_weight_bytes"] > 0 for s in stats)
        assert all(s["sidp_cas_fused_rows"] == 0 for s in stats)
    else:
        assert all(s["sidp_fetched_weight_bytes"] == 0 for s in stats)
        assert all(s["sidp_cas_fused_rows"] > 0 for s in stats)


def test_cas_with_an_idle_tp_replica_running_dummy_steps(
    tiny_checkpoint,
    replica_factory,  # noqa: F811
) -> None:
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=4)
    prompts = _prompts(3)
    want = dict(zip(map(tuple, prompts), _reference(folder, prompts, 6), strict=True))
    group = replica_factory(folder, {**SIDP, "mode": "CAS"})
    work = _work(2, prompts, 6, idle={1})
    _assert_all_equal(group.generate(work), work, want)
    # The idle replica's ranks served their shards of its layers to replica 0.
    assert group.stats(1)["policy"]["sidp_cas_fused_rows"] > 0
    assert group.stats(1)["engine"].steps == 0


def test_mode_switches_mid_generation_with_tp_replicas(
    tiny_checkpoint,
    replica_factory,  # noqa: F811
) -> None:
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=4)
    prompts = _prompts(4)
    want = dict(zip(map(tuple, prompts), _reference(folder, prompts, 30), strict=True))
    group = replica_factory(folder, {**SIDP, "mode": "WAS"})
    done: list[int] = []
    flipper = threading.Thread(target=_flip_modes, args=(group.store.port, 2, 4, done))
    flipper.start()
    try:
        work = _work(2, prompts, 30)
        results = group.generate(work)
    finally:
        flipper.join(70)
    _assert_all_equal(results, work, want)
    assert len(done) == 4
    syncs = [group.stats(r)["sync"] for r in range(2)]
    assert syncs[0]["switches"] == syncs[1]["switches"] == 4, syncs
    for sync in syncs:
        assert {m for _, m, _ in sync["tags"]} == {int(Mode.WAS), int(Mode.CAS)}
    by_step = [{g: (s, m) for s, m, g in sync["tags"] if g >= 0} for sync in syncs]
    common = by_step[0].keys() & by_step[1].keys()
    assert common and all(by_step[0][g] == by_step[1][g] for g in common)


def test_each_tp_rank_holds_its_formula_and_kv_gets_the_freed_ffn_bytes(
    tiny_checkpoint,
    replica_factory,  # noqa: F811
) -> None:
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=6)
    spec, source = inspect_model(EngineConfig(model=str(folder), **ENGINE), torch.device("cpu"))
    source.close()
    cfg = spec.config
    group = replica_factory(folder, SIDP)  # 1 slot, 3 owned layers of 6, half of each per rank
    tp1 = weight_bytes(cfg, Ownership(2, 6), 0, slots=1, element_size=4)
    # One KV head of the two per TP rank.
    kv = KVCacheSpec(cfg.num_layers, 1, cfg.head_dim, 4, torch.float32)
    plain_blocks = kv.blocks_for_bytes(ENGINE["kv_cache_bytes"])
    for r in range(2):
        expected = weight_bytes(cfg, Ownership(2, 6), r, slots=1, element_size=4, tp=2)
        # The leading rank reports its own bytes (TP rank 0; TP rank 1 holds the same count).
        assert group.stats(r)["policy"]["sidp_resident_weight_bytes"] == expected.resident
        assert expected.ffn_layer < tp1.ffn_layer and expected.replicated < tp1.replicated
        freed = expected.freed(6)
        assert freed == 2 * expected.ffn_layer
        blocks = group.ready[r]["num_blocks"]
        assert blocks == kv.blocks_for_bytes(ENGINE["kv_cache_bytes"] + freed) > plain_blocks


def test_a_tp_size_the_heads_do_not_split_over_is_refused(tiny_checkpoint) -> None:
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=4)
    spec, source = inspect_model(EngineConfig(model=str(folder), **ENGINE), torch.device("cpu"))
    source.close()
    policy = make_policy({"sidp": {"dp": 2, "tp": 3}})
    with pytest.raises(InvalidRequestError, match=r"policy\.sidp\.tp"):
        policy.check_model(spec.config)


def test_a_killed_tp_follower_ends_the_group_naming_its_replica(
    tiny_checkpoint,
    replica_factory,  # noqa: F811
) -> None:
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=4)
    group = replica_factory(
        folder,
        {**SIDP, "mode": "CAS"},
        group=GroupConfig(timeout_s=30, heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0),
    )
    group.procs[3].kill()  # replica 1's second TP rank
    group.procs[3].join(10)
    with pytest.raises(GroupFailure, match=r"replica 1 \(rank 3\)"):
        group.generate(_work(2, _prompts(2), 4))
    # Shared weights make the whole group one failure domain (§4.4): every other rank ends.
    for proc in group.procs:
        proc.join(30)
        assert not proc.is_alive()
    group.kill()
    clean_stale()
    assert segments(pids=[os.getpid(), *(p.pid for p in group.procs)]) == []
