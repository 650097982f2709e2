"""SiDP replica groups against the single-process reference (fp32, gloo, real processes).

Every replica's greedy tokens equal the one-process engine's, in WaS, in CaS (with idle replicas
running dummy steps), and across group-wide mode switches in the middle of generations; each rank
holds exactly its formula's weights and the KV cache gets the FFN bytes it frees. No replica,
shared-memory segment or KV block outlives a group.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from gearshift.worker.config import EngineConfig
from gearshift.worker.engine.loading import inspect_model
from gearshift.worker.errors import GroupFailure
from gearshift.worker.kv.cache import KVCacheSpec
from gearshift.worker.launch import start_engine
from gearshift.worker.launch.group_config import GroupConfig
from gearshift.worker.launch.replicas import ReplicaGroup, start_replicas
from gearshift.worker.policies.registry import make_policy
from gearshift.worker.policies.sidp.ffn import Mode
from gearshift.worker.policies.sidp.group_step import applied_epochs, request_mode
from gearshift.worker.policies.sidp.ownership import Ownership, weight_bytes
from gearshift.worker.policies.sidp.shared_weights import clean_stale, segments
from gearshift.worker.sampling.params import SamplingParams

ENGINE: dict[str, Any] = {
    "dtype": "float32",
    "kv_cache_bytes": 4 << 20,
    "skip_tokenizer_init": True,
    "block_size": 4,
    "max_num_batched_tokens": 32,
}
Work = dict[int, list[tuple[str, list[int], SamplingParams]]]


def _prompts(n: int, vocab: int = 128, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(k),), generator=g).tolist() for k in [5, 11, 2, 19, 7][:n]]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _reference(folder: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    engine = start_engine(EngineConfig(model=str(folder), **ENGINE))
    try:
        return [o.token_ids for o in engine.generate(prompts, _greedy(max_tokens))]
    finally:
        engine.shutdown()


@pytest.fixture
def replica_factory() -> Iterator[Callable[..., ReplicaGroup]]:
    """Start SiDP groups; each stops with every KV block free and leaves no segment behind."""
    groups: list[ReplicaGroup] = []

    def start(folder: Path, sidp: dict[str, Any], **kw: Any) -> ReplicaGroup:
        group = kw.pop("group", None) or GroupConfig(timeout_s=120)
        config = EngineConfig(model=str(folder), **{**ENGINE, **kw})
        handle = start_replicas(config, make_policy({"sidp": sidp}), group)
        groups.append(handle)
        return handle

    yield start
    for handle in groups:
        if handle._closed:
            continue
        reports = handle.shutdown()
        assert all(r["leaked_blocks"] == 0 and r["all_free"] for r in reports), reports
        assert all(not p.is_alive() for p in handle.procs), "a replica outlived its group"
    # Only this test's: another test's group may run beside it (pytest-xdist workers).
    mine = [os.getpid(), *(p.pid for h in groups for p in h.procs)]
    assert segments(pids=mine) == [], "shared-memory segments left behind"


def _assert_all_equal(results: dict[str, tuple[list[int], str]], work: Work, want: dict) -> None:
    for reqs in work.values():
        for rid, ids, _ in reqs:
            tokens, reason = results[rid]
            assert reason == "length", (rid, reason)
            assert tokens == want[tuple(ids)], rid


def _work(dp: int, prompts: list[list[int]], max_tokens: int, idle: set[int] = frozenset()) -> Work:
    # Each replica gets the prompts in another order, so replicas' batches differ.
    return {
        r: [(f"r{r}-{i}", p, _greedy(max_tokens)) for i, p in enumerate(prompts[r:] + prompts[:r])]
        for r in range(dp)
        if r not in idle
    }


@pytest.mark.parametrize(
    ("dp", "layers", "mode"), [(2, 4, "WAS"), (3, 5, "WAS"), (2, 4, "CAS"), (3, 5, "CAS")]
)
def test_every_replica_matches_the_single_process_reference(
    tiny_checkpoint, replica_factory, dp: int, layers: int, mode: str
) -> None:
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=layers)
    prompts = _prompts(4)
    want = dict(zip(map(tuple, prompts), _reference(folder, prompts, 8), strict=True))
    group = replica_factory(folder, {"dp": dp, "mode": mode})
    work = _work(dp, prompts, 8)
    _assert_all_equal(group.generate(work), work, want)
    stats = [group.stats(r)["policy"] for r in range(dp)]
    if mode == "WAS":
        # Remote layers came through the slots; CaS never ran.
        assert all(s["sidp_fetched_weight_bytes"] > 0 for s in stats)
        assert all(s["sidp_cas_fused_rows"] == 0 for s in stats)
    else:
        assert all(s["sidp_fetched_weight_bytes"] == 0 for s in stats)
        assert all(s["sidp_cas_fused_rows"] > 0 for s in stats)


def test_idle_replicas_run_dummy_steps_that_owners_skip_in_cas(tiny_checkpoint, replica_factory):
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=6)
    prompts = _prompts(3)
    want = dict(zip(map(tuple, prompts), _reference(folder, prompts, 6), strict=True))
    group = replica_factory(folder, {"dp": 3, "mode": "CAS"})
    work = _work(3, prompts, 6, idle={1, 2})
    _assert_all_equal(group.generate(work), work, want)
    busy = group.stats(0)["policy"]
    # Replica 0 owns layers 0 and 3 and skipped the two idle replicas there on every step.
    assert busy["sidp_skipped_dummies"] > 0
    idle = group.stats(1)["policy"]
    # The idle replica served its own layers (1 and 4) to replica 0: rows of replica 0 only.
    assert idle["sidp_cas_fused_rows"] > 0
    assert group.stats(1)["engine"].steps == 0  # it ran no step of its own


def _flip_modes(port: int, replicas: int, flips: int, done: list[int]) -> None:
    """Request CaS, WaS, CaS, ... each once every replica has applied the previous one."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    mode = Mode.CAS
    for _ in range(flips):
        epoch = request_mode(store, mode)
        deadline = time.monotonic() + 60
        while min(applied_epochs(store, replicas)) < epoch:
            assert time.monotonic() < deadline, "a requested switch never took effect"
            time.sleep(0.005)
        done.append(epoch)
        mode = Mode.WAS if mode == Mode.CAS else Mode.CAS


def test_mode_switches_mid_generation_keep_greedy_text_and_one_mode_per_step(
    tiny_checkpoint, replica_factory
):
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=4)
    prompts = _prompts(4)
    want = dict(zip(map(tuple, prompts), _reference(folder, prompts, 40), strict=True))
    group = replica_factory(folder, {"dp": 2, "mode": "WAS"})
    done: list[int] = []
    flipper = threading.Thread(target=_flip_modes, args=(group.store.port, 2, 5, done))
    flipper.start()
    try:
        work = _work(2, prompts, 40)
        results = group.generate(work)
    finally:
        flipper.join(70)
    _assert_all_equal(results, work, want)
    assert len(done) == 5
    syncs = [group.stats(r)["sync"] for r in range(2)]
    assert syncs[0]["switches"] == syncs[1]["switches"] == 5, syncs
    for sync in syncs:
        # Steps with work ran in both modes on each replica: the switches were mid-generation.
        assert {m for _, m, _ in sync["tags"]} == {int(Mode.WAS), int(Mode.CAS)}
    # Every CaS step (numbered the same on every replica) carries the same (switch count, mode)
    # tag on both replicas: no step ran with mixed modes.
    by_step = [{g: (s, m) for s, m, g in sync["tags"] if g >= 0} for sync in syncs]
    common = by_step[0].keys() & by_step[1].keys()
    assert common, "no CaS step ran"
    assert all(by_step[0][g] == by_step[1][g] for g in common)
    assert all(m == int(Mode.CAS) for g in common for _, m in [by_step[0][g]])
    # A WaS step never runs between two CaS steps of the same switch epoch on any replica.
    for sync in syncs:
        epochs_modes = {(s, m) for s, m, _ in sync["tags"]}
        assert len({s for s, _ in epochs_modes}) == len(epochs_modes)


def test_each_rank_holds_its_formula_and_kv_gets_the_freed_ffn_bytes(
    tiny_checkpoint, replica_factory
):
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=6)
    spec, source = inspect_model(EngineConfig(model=str(folder), **ENGINE), torch.device("cpu"))
    source.close()
    cfg = spec.config
    group = replica_factory(folder, {"dp": 2})  # 1 slot, 3 owned layers of 6
    kv = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4, torch.float32)
    plain_blocks = kv.blocks_for_bytes(ENGINE["kv_cache_bytes"])
    for r in range(2):
        expected = weight_bytes(cfg, Ownership(2, 6), r, slots=1, element_size=4)
        assert group.stats(r)["policy"]["sidp_resident_weight_bytes"] == expected.resident
        freed = expected.freed(6)
        assert freed == 2 * expected.ffn_layer  # 3 remote layers less 1 slot
        blocks = group.ready[r]["num_blocks"]
        assert blocks == kv.blocks_for_bytes(ENGINE["kv_cache_bytes"] + freed) > plain_blocks


def test_a_killed_replica_ends_the_group_with_a_named_error(tiny_checkpoint, replica_factory):
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=4)
    group = replica_factory(
        folder,
        {"dp": 2, "mode": "CAS"},
        group=GroupConfig(timeout_s=30, heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0),
    )
    group.procs[1].kill()
    group.procs[1].join(10)
    with pytest.raises(GroupFailure, match="replica 1"):
        group.generate(_work(2, _prompts(2), 4, idle={1}))
    # The survivor's watchdog ends it: the group is one failure domain (§4.4).
    group.procs[0].join(30)
    assert not group.procs[0].is_alive()
    group.kill()
    # The dead owners' segments are stale now; the next start (here: the cleaner) unlinks them.
    clean_stale()
    assert segments(pids=[os.getpid(), *(p.pid for p in group.procs)]) == []


def test_stale_segments_of_dead_processes_are_cleaned_at_start(tmp_path: Path) -> None:
    from gearshift.worker.policies.sidp import shared_weights

    dead = tmp_path / "gearshift-sidp-local-999999999-abcdef-l0"
    dead.write_bytes(b"x")
    live = tmp_path / f"gearshift-sidp-local-{__import__('os').getpid()}-abcdef-l1"
    live.write_bytes(b"x")
    assert shared_weights.clean_stale(tmp_path) == [dead.name]
    assert not dead.exists() and live.exists()


@pytest.mark.slow
def test_smollm2_three_replicas_match_the_reference(smollm2_path, replica_factory) -> None:
    prompts = _prompts(3, vocab=49152)
    ref_engine = {**ENGINE, "kv_cache_bytes": 16 << 20, "max_model_len": 256}
    engine = start_engine(EngineConfig(model=str(smollm2_path), **ref_engine))
    try:
        want_list = [o.token_ids for o in engine.generate(prompts, _greedy(6))]
    finally:
        engine.shutdown()
    want = dict(zip(map(tuple, prompts), want_list, strict=True))
    group = replica_factory(smollm2_path, {"dp": 3}, kv_cache_bytes=16 << 20, max_model_len=256)
    work = _work(3, prompts, 6)
    _assert_all_equal(group.generate(work), work, want)


def test_the_routers_controller_switches_a_live_group_by_batch_size(
    tiny_checkpoint, replica_factory
):
    from gearshift.operator.router.sidp_controller import ControllerParameters, ModeController

    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=4)
    prompts = _prompts(5)
    lengths = [2, 4, 8, 30, 40]  # the batch drains from 5 to 1: a heavy tail
    want_all = {
        (tuple(p), n): _reference(folder, [p], n)[0] for p, n in zip(prompts, lengths, strict=True)
    }
    group = replica_factory(folder, {"dp": 2, "mode": "AUTO"})
    store = group.store
    epochs: list[int] = []
    ctl = ModeController(
        ControllerParameters(
            cas_enter_batch_size=2, was_enter_batch_size=4, window_steps=2, min_dwell_steps=2
        ),
        lambda mode: epochs.append(request_mode(store, Mode(mode))),
    )
    work = {
        r: [
            (f"r{r}-{i}", p, _greedy(n))
            for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
        ]
        for r in range(2)
    }
    pending = group.submit(work)
    results: dict[str, tuple[list[int], str]] = {}
    deadline = time.monotonic() + 120
    while any(pending.values()):
        assert time.monotonic() < deadline
        group.poll(pending, results, wait_s=0.002)
        ctl.observe([group.stats(r)["engine"].num_running for r in range(2)])
    for reqs in work.values():
        for rid, ids, params in reqs:
            assert results[rid][0] == want_all[(tuple(ids), params.max_tokens)], rid
    assert ctl.switches >= 1 and epochs
    # Every replica applies the controller's last decision (idle ones at their next poll).
    while min(applied_epochs(store, 2)) < epochs[-1]:
        assert time.monotonic() < deadline, "the group never applied the controller's switch"
        time.sleep(0.01)
    assert all(group.stats(r)["sync"]["mode"] == ctl.mode for r in range(2))


@pytest.mark.parametrize("mode", ["WAS", "CAS"])
def test_one_replica_is_a_plain_engine_that_owns_every_layer(tiny_checkpoint, mode: str):
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=4)
    prompts = _prompts(2)
    want = _reference(folder, prompts, 6)
    engine = start_engine(EngineConfig(model=str(folder), **ENGINE), {"sidp": {"mode": mode}})
    try:
        got = [o.token_ids for o in engine.generate(prompts, _greedy(6))]
        stats = engine.policy.stats()
    finally:
        engine.shutdown()
    assert got == want
    assert stats["sidp_fetched_weight_bytes"] == 0  # nothing is remote
    assert segments(pids=[os.getpid()]) == []
