"""gearshift.worker.p2p on real multi-process gloo groups: traffic arrives as sent, plainly and
under GEARSHIFT_COMM_RULES=nccl; each kind of violation of NCCL's rules is caught under the rules,
naming both sides; a peer killed mid-exchange fails the waiting rank, naming it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from gearshift.worker.launch.processes import run_ranks
from gearshift.worker.p2p import COMM_RULES_ENV, CommRules, comm_rules
from gearshift.worker.p2p.header import Header
from gearshift.worker.sampling.params import SamplingParams
from tests.worker.p2p import p2p_driver

BOUND_S = 120  # every scenario's ranks end within this, or are killed and the test fails


def _run(tmp: Path, scenario: str, rules: str, world: int = 2) -> dict[int, dict[str, Any]]:
    tmp.mkdir(parents=True, exist_ok=True)
    args = [(r, world, str(tmp / "store"), str(tmp), scenario, rules) for r in range(world)]
    codes = run_ranks(p2p_driver.run_rank, args, f"p2p-{scenario}", BOUND_S)
    results = {}
    for r in range(world):
        path = tmp / f"rank-{r}.json"
        if path.is_file():
            results[r] = json.loads(path.read_text())
    if scenario != "dead_peer":
        assert codes == [0] * world, f"a rank failed or hung: {codes}"
    return results


@pytest.mark.parametrize("rules", ["gloo", "nccl"])
def test_messages_arrive_as_sent_in_fifo_order_with_batches(tmp_path, rules):
    got = _run(tmp_path, "roundtrip", rules)
    assert got[0]["swap"] == [10.0 + i for i in range(6)]
    assert got[1]["swap"] == [float(i) for i in range(6)]
    assert got[1]["fifo"] == [0.0, 1.0, 2.0]
    assert got[1]["strided"] == [[0, 1, 2], [3, 4, 5]]
    assert got[0]["back"] == [7, 8, 9]


def test_a_batch_round_a_ring_of_three_passes_every_value(tmp_path):
    got = _run(tmp_path, "ring3", "nccl", world=3)
    for rank in range(3):
        assert got[rank]["seen"] == [(rank - 1) % 3, (rank - 2) % 3, rank]


def test_out_of_order_receives_fail_naming_both_messages(tmp_path):
    error = _run(tmp_path, "out_of_order", "nccl")[1]["error"]
    assert error.startswith("RuleViolation")
    assert "rank 0 sent 'a' float32[2] as its message #0" in error
    assert "receive #0 from rank 0 expects 'b' float32[2]" in error


def test_a_longer_payload_fails_its_receive_instead_of_aborting_gloo(tmp_path):
    error = _run(tmp_path, "wrong_shape", "nccl")[1]["error"]
    assert "'rows' float32[3]" in error and "expects 'rows' float32[2]" in error


def test_a_wrong_dtype_fails_naming_both_dtypes(tmp_path):
    error = _run(tmp_path, "wrong_dtype", "nccl")[1]["error"]
    assert "'ids' int64[2]" in error and "expects 'ids' float32[2]" in error


def test_tags_are_refused_under_the_nccl_rules(tmp_path):
    got = _run(tmp_path, "tagged", "nccl")[0]
    assert got["isend"].startswith("RuleViolation") and "tag 5" in got["isend"]
    assert got["p2pop"].startswith("RuleViolation") and "tag 6" in got["p2pop"]


def test_ungrouped_opposite_directions_are_refused_under_the_rules_only(tmp_path):
    checked = _run(tmp_path / "nccl", "opposite", "nccl")
    error = checked[0]["error"]
    assert error.startswith("RuleViolation")
    assert "receive of 'y' float32[2] from rank 1" in error
    assert "send of 'x' float32[2] to rank 1 is not waited for" in error
    assert checked[0]["back"] == [2.0, 2.0] and checked[0]["batched"] == 1.0
    plain = _run(tmp_path / "gloo", "opposite", "gloo")
    assert plain[0]["error"] == "" and plain[0]["back"] == [2.0, 2.0]
    assert plain[1]["batched"] == 0.0


@pytest.mark.parametrize("rules", ["gloo", "nccl"])
def test_a_peer_killed_mid_exchange_fails_the_waiting_rank_naming_it(tmp_path, rules):
    got = _run(tmp_path, "dead_peer", rules)
    assert 1 not in got, "the killed rank wrote no result"
    error = got[0]["error"]
    assert error.startswith("RuntimeError") and "rank 1" in error, error


def test_an_unknown_rule_set_is_refused_naming_the_variable():
    assert comm_rules({}) is CommRules.PLAIN
    assert comm_rules({COMM_RULES_ENV: "gloo"}) is CommRules.PLAIN
    assert comm_rules({COMM_RULES_ENV: "NCCL"}) is CommRules.NCCL
    with pytest.raises(ValueError, match=COMM_RULES_ENV):
        comm_rules({COMM_RULES_ENV: "mpi"})


def test_a_header_round_trips_and_names_what_differs():
    head = Header.of(3, 1, torch.empty(2, 5, dtype=torch.bfloat16), "kv layer 4")
    back = Header.decode(head.encode())
    assert back == head
    assert back.mismatch(0, 3, (2, 5), torch.bfloat16, "kv layer 4") is None
    why = back.mismatch(0, 3, (2, 5), torch.bfloat16, "kv layer 5")
    assert why is not None and "'kv layer 4' bfloat16[2, 5]" in why and "'kv layer 5'" in why


def test_groups_the_suite_starts_check_their_traffic(tiny_checkpoint, group_factory):
    # tests/conftest.py sets GEARSHIFT_COMM_RULES=nccl: a pipeline's two channels carry headers.
    folder = tiny_checkpoint("llama2-bias", num_heads=4, num_kv_heads=2, layers=2)
    engine = group_factory(
        folder, {"static": {"pp": 2}}, record=False, skip_tokenizer_init=True, block_size=4
    )
    stage = engine.executor.runner.gears[0].stage
    assert stage.activations.headers and engine.executor.logits_channel.headers
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert len(engine.generate([[1, 2, 3]], params)[0].token_ids) == 4
