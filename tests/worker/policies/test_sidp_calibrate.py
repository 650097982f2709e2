"""AUTO's thresholds come from the running group (SiDP §4.3 B_th): timed at start-up on the real
replicas (fp32, gloo, real processes) or read from a profile file; when CaS never wins AUTO pins
WaS and the group's figures say so."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gearshift.worker.config import EngineConfig
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.launch import start_engine
from gearshift.worker.launch.group_config import GroupConfig
from gearshift.worker.launch.replicas import ReplicaGroup, start_replicas
from gearshift.worker.policies.registry import make_policy
from gearshift.worker.policies.sidp.calibrate import BATCHES
from gearshift.worker.policies.sidp.shared_weights import segments
from gearshift.worker.policies.sidp.thresholds import (
    PROFILE_ENV,
    SOURCE_DEFAULT,
    SOURCE_EXPLICIT,
    SOURCE_MEASURED,
    SOURCE_PROFILE,
    thresholds_from_profile,
)
from gearshift.worker.sampling.params import SamplingParams

ENGINE: dict[str, Any] = {
    "dtype": "float32",
    "kv_cache_bytes": 4 << 20,
    "skip_tokenizer_init": True,
    "block_size": 4,
    "max_num_batched_tokens": 32,
}


@pytest.fixture
def group_of(tiny_checkpoint) -> Iterator[Any]:
    started: list[ReplicaGroup] = []
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=4)

    def start(sidp: dict[str, Any]) -> ReplicaGroup:
        config = EngineConfig(model=str(folder), **ENGINE)
        handle = start_replicas(config, make_policy({"sidp": sidp}), GroupConfig(timeout_s=120))
        started.append(handle)
        return handle

    start.folder = folder  # type: ignore[attr-defined]
    yield start
    for handle in started:
        reports = handle.shutdown()
        assert all(r["leaked_blocks"] == 0 and r["all_free"] for r in reports), reports
    # Only this test's: another test's group may run beside it (pytest-xdist workers).
    assert segments(pids=[os.getpid(), *(p.pid for h in started for p in h.procs)]) == []


def _profile_figures(stats: dict[str, float]) -> tuple[dict[int, float], dict[int, float]]:
    was = {b: stats[f"sidp_profile_was_ms_b{b}"] for b in BATCHES}
    cas = {b: stats[f"sidp_profile_cas_ms_b{b}"] for b in BATCHES}
    return was, cas


def test_an_auto_group_times_both_modes_at_start_up_and_agrees_on_its_thresholds(
    group_of,
) -> None:
    group = group_of({"dp": 2, "mode": "AUTO"})
    stats = [group.stats(r)["policy"] for r in range(2)]
    hidden = 64  # the tiny checkpoint: FFN of 3 matrices of hidden x 2 hidden, biases, fp32
    ffn_layer = (3 * hidden * 2 * hidden + 2 * 2 * hidden + hidden) * 4
    assert all(s["sidp_thresholds_source"] == SOURCE_MEASURED for s in stats)
    was, cas = _profile_figures(stats[0])
    assert all(t > 0 for t in [*was.values(), *cas.values()])
    assert _profile_figures(stats[1]) == (was, cas), "every replica takes the group's figures"
    found = thresholds_from_profile(was, cas)
    for s in stats:
        assert s["sidp_auto_pins_was"] == (1.0 if found is None else 0.0)
        if found is not None:
            assert (s["sidp_cas_enter_batch_size"], s["sidp_was_enter_batch_size"]) == found
        # The timing steps are not the group's work: its figures start afresh (the housekeeper
        # may already hold the first step's window: at most one pass of the 2 remote layers).
        assert s["sidp_cas_fused_rows"] == 0
        assert s["sidp_fetched_weight_bytes"] <= 2 * ffn_layer
        assert s["sidp_mode"] == 2.0  # AUTO starts in WaS
    # The scratch steps left nothing behind: greedy text equals one process's.
    prompts = [[5, 9, 1, 30], [7, 7, 2]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine = start_engine(EngineConfig(model=str(group_of.folder), **ENGINE))
    try:
        want = [o.token_ids for o in engine.generate(prompts, params)]
    finally:
        engine.shutdown()
    work = {r: [(f"{r}-{i}", p, params) for i, p in enumerate(prompts)] for r in range(2)}
    got = group.generate(work)
    assert [[got[f"{r}-{i}"][0] for i in range(2)] for r in range(2)] == [want, want]
    # The host's view for the router: one set of group figures.
    merged = group.policy.group_stats(stats)
    assert merged["sidp_thresholds_source"] == SOURCE_MEASURED
    assert merged["sidp_auto_pins_was"] == stats[0]["sidp_auto_pins_was"]


def test_pinned_or_explicit_groups_measure_nothing(group_of) -> None:
    pinned = group_of({"dp": 2, "mode": "WAS"})
    stats = pinned.stats(0)["policy"]
    assert stats["sidp_thresholds_source"] == SOURCE_DEFAULT
    assert not any(k.startswith("sidp_profile_") for k in stats)
    explicit = group_of({"dp": 2, "casEnterBatchSize": 4, "wasEnterBatchSize": 8})
    stats = explicit.stats(1)["policy"]
    assert stats["sidp_thresholds_source"] == SOURCE_EXPLICIT
    assert not any(k.startswith("sidp_profile_") for k in stats)


def _write(tmp_path: Path, body: Any) -> str:
    path = tmp_path / "profile.json"
    path.write_text(body if isinstance(body, str) else json.dumps(body))
    return str(path)


def test_a_profile_file_gives_the_thresholds_or_pins_was(tmp_path, monkeypatch) -> None:
    was = {"1": 10.0, "4": 11.0, "16": 12.0, "64": 20.0}
    monkeypatch.setenv(
        PROFILE_ENV,
        _write(tmp_path, {"was_ms": was, "cas_ms": {"1": 5.0, "4": 9.0, "16": 13.0, "64": 30.0}}),
    )
    policy = make_policy({"sidp": {"dp": 2}})
    assert policy.thresholds_source == SOURCE_PROFILE
    sidp = policy.to_proto().sidp
    assert (sidp.cas_enter_batch_size, sidp.was_enter_batch_size) == (16, 32)
    monkeypatch.setenv(
        PROFILE_ENV, _write(tmp_path, {"was_ms": was, "cas_ms": dict.fromkeys(was, 99.0)})
    )
    policy = make_policy({"sidp": {"dp": 2}})
    assert policy.profile is not None and policy.profile.thresholds is None
    assert "AUTO pins WaS" in policy.profile.why()
    # Thresholds the policy sets win over the file.
    policy = make_policy({"sidp": {"dp": 2, "casEnterBatchSize": 3, "wasEnterBatchSize": 6}})
    assert policy.thresholds_source == SOURCE_EXPLICIT and policy.profile is None
    assert policy.to_proto().sidp.cas_enter_batch_size == 3


@pytest.mark.parametrize(
    "body",
    [
        "not json",
        {"was_ms": {"1": 1.0}},
        {"was_ms": {"1": 1.0}, "cas_ms": {"2": 1.0}},
        {"was_ms": {"0": 1.0}, "cas_ms": {"0": 1.0}},
        {"was_ms": {"1": -1.0}, "cas_ms": {"1": 1.0}},
        {"was_ms": {"1": "fast"}, "cas_ms": {"1": 1.0}},
    ],
)
def test_a_bad_profile_file_is_refused_naming_the_variable(tmp_path, monkeypatch, body) -> None:
    monkeypatch.setenv(PROFILE_ENV, _write(tmp_path, body))
    with pytest.raises(InvalidRequestError, match=PROFILE_ENV):
        make_policy({"sidp": {"dp": 2}})
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(InvalidRequestError, match=PROFILE_ENV):
        make_policy({"sidp": {"dp": 2}})


def test_a_group_started_with_a_profile_file_reports_it_and_measures_nothing(
    group_of, tmp_path, monkeypatch
) -> None:
    times = {"1": 10.0, "4": 11.0}
    monkeypatch.setenv(PROFILE_ENV, _write(tmp_path, {"was_ms": times, "cas_ms": times}))
    group = group_of({"dp": 2})
    stats = group.stats(0)["policy"]
    assert stats["sidp_thresholds_source"] == SOURCE_PROFILE
    assert stats["sidp_auto_pins_was"] == 1.0  # CaS tied, never faster
    assert "sidp_profile_was_ms_b16" not in stats  # nothing was timed on the group
