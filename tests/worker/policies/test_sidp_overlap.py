"""SiDP CaS with overlap: each replica's step runs as two micro-batches whose exchange with a
layer's owner is in flight while the other micro-batch's attention runs (SiDP §4.3) (fp32, gloo
under NCCL's rules, real processes).

Greedy tokens equal the one-process engine's with overlap on for dp 2 and 3, with idle replicas
(dummy steps), with uneven rows per replica and a one-row replica that cannot split, and with TP
inside replicas; the overlap is counted (messages still posted while the other half's attention
ran), and none is counted with ``casOverlap`` off (the default). The attention split itself is
checked against the unsplit batch at every cut; ``casOverlap`` cannot change while a group runs.
"""

from __future__ import annotations

import os

import pytest
import torch

from gearshift.v1 import policy_pb2
from gearshift.worker.attention.cpu_backend import CpuAttention
from gearshift.worker.attention.torch_ref import TorchAttention
from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.p2p import COMM_RULES_ENV
from gearshift.worker.policies.registry import make_policy
from gearshift.worker.policies.sidp.cas import split_rows
from gearshift.worker.policies.sidp.ownership import Ownership
from gearshift.worker.server.convert import live_update
from tests.worker.attention.triton_batches import make_batch
from tests.worker.policies.test_sidp_replicas import (
    Work,
    _assert_all_equal,
    _greedy,
    _prompts,
    _reference,
    _work,
    replica_factory,  # noqa: F401 - the fixture
)


def test_split_rows_is_two_halves_from_two_rows_on() -> None:
    assert split_rows(0, True) == []
    assert split_rows(1, True) == [1]
    assert split_rows(2, True) == [1, 1]
    assert split_rows(7, True) == [4, 3]
    assert split_rows(7, False) == [7]


@pytest.mark.parametrize("backend", [CpuAttention, TorchAttention])
def test_split_batch_attends_as_the_whole_at_every_cut(backend: type) -> None:
    # Decodes, a chunk with cached history, and a fresh chunk: every cut, including cuts inside
    # a chunk (the second part attends to the first's KV as history).
    batch = make_batch(
        [9, 3, 14], [(5, 12), (6, 6)], kv_heads=2, group=2, head_dim=8, block_size=4, seed=5
    )
    core = backend(8**-0.5)
    kv_whole = batch.kv()
    whole = core.forward(batch.q, batch.k, batch.v, kv_whole, batch.meta)
    tokens = batch.q.shape[0]
    for cut in range(1, tokens):
        first, second = batch.meta.split(cut)
        assert first.num_actual_tokens == cut and second.num_actual_tokens == tokens - cut
        kv = batch.kv()
        halves = (slice(0, cut), slice(cut, tokens))
        outs = [
            core.forward(batch.q[h], batch.k[h], batch.v[h], kv, m)
            for h, m in zip(halves, (first, second), strict=True)
        ]
        torch.testing.assert_close(torch.cat(outs), whole, rtol=1e-5, atol=1e-5, msg=f"cut {cut}")
        assert torch.equal(kv[0], kv_whole[0]) and torch.equal(kv[1], kv_whole[1]), cut


def test_a_batch_with_padding_or_an_empty_half_is_not_split() -> None:
    batch = make_batch([5, 6], [], kv_heads=1, group=1, head_dim=4, block_size=4, padding=2)
    with pytest.raises(ValueError, match="padding 2"):
        batch.meta.split(1)
    plain = make_batch([5, 6], [], kv_heads=1, group=1, head_dim=4, block_size=4)
    for cut in (0, 2):
        with pytest.raises(ValueError, match="cannot split"):
            plain.meta.split(cut)


def _per_split_step(dp: int, layers: int, replica: int) -> int:
    """Overlapped messages of one split step: per layer it does not own, A's rows during B's
    attention, and B's answer during A's attention of the next layer (none after the last)."""
    own = Ownership(dp, layers)
    remote = [layer for layer in range(layers) if own.owner(layer) != replica]
    return len(remote) + len([layer for layer in remote if layer < layers - 1])


def _check_overlap(group, dp: int, layers: int, split: set[int]) -> None:
    # The group ran under NCCL's point-to-point rules (tests/conftest.py sets them for every
    # test): each message's header was checked against its receive.
    assert os.environ[COMM_RULES_ENV] == "nccl"
    for r in range(dp):
        stats = group.stats(r)["policy"]
        done = int(stats["sidp_cas_overlapped"])
        if r in split:
            # Whole split steps only: every one posts the same messages.
            assert done > 0 and done % _per_split_step(dp, layers, r) == 0, (r, done)
        else:
            assert done == 0, (r, done)
        assert 0 <= stats["sidp_cas_overlapped_moving"] <= done


@pytest.mark.parametrize(("dp", "layers"), [(2, 4), (3, 5)])
def test_overlapped_cas_matches_the_reference(tiny_checkpoint, replica_factory, dp, layers):  # noqa: F811
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=layers)
    prompts = _prompts(4)
    want = dict(zip(map(tuple, prompts), _reference(folder, prompts, 8), strict=True))
    group = replica_factory(folder, {"dp": dp, "mode": "CAS", "casOverlap": True})
    work = _work(dp, prompts, 8)
    _assert_all_equal(group.generate(work), work, want)
    _check_overlap(group, dp, layers, set(range(dp)))
    assert all(group.stats(r)["policy"]["sidp_cas_fused_rows"] > 0 for r in range(dp))


@pytest.mark.parametrize("sidp", [{"casOverlap": False}, {}])
def test_overlap_off_posts_nothing_in_flight(tiny_checkpoint, replica_factory, sidp):  # noqa: F811
    # Off by default (benchmarks/sidp_overlap.py: slower on the CPU hosts measured).
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=4)
    prompts = _prompts(4)
    want = dict(zip(map(tuple, prompts), _reference(folder, prompts, 6), strict=True))
    group = replica_factory(folder, {"dp": 2, "mode": "CAS", **sidp})
    work = _work(2, prompts, 6)
    _assert_all_equal(group.generate(work), work, want)
    _check_overlap(group, 2, 4, set())


def test_idle_replicas_and_uneven_rows_with_overlap(tiny_checkpoint, replica_factory):  # noqa: F811
    layers = 6
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=layers)
    prompts = _prompts(5)
    single = [7]  # one token: its replica has one row in every step and never splits
    every = [*prompts, single]
    want = dict(zip(map(tuple, every), _reference(folder, every, 6), strict=True))
    group = replica_factory(folder, {"dp": 4, "mode": "CAS", "casOverlap": True})
    # Replica 0: four sequences, replica 1: one of one row, replica 2: two, replica 3: idle.
    work: Work = {
        0: [(f"a{i}", p, _greedy(6)) for i, p in enumerate(prompts[:4])],
        1: [("b0", single, _greedy(6))],
        2: [(f"c{i}", p, _greedy(6)) for i, p in enumerate(prompts[3:])],
    }
    _assert_all_equal(group.generate(work), work, want)
    _check_overlap(group, 4, layers, {0, 2})
    # The idle replica served its layers; owners skipped it (dummy skipping).
    assert group.stats(3)["policy"]["sidp_cas_fused_rows"] > 0
    assert group.stats(3)["engine"].steps == 0
    assert group.stats(0)["policy"]["sidp_skipped_dummies"] > 0


def test_overlap_with_tp_ranks_inside_replicas(tiny_checkpoint, replica_factory):  # noqa: F811
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=4)
    prompts = _prompts(4)
    want = dict(zip(map(tuple, prompts), _reference(folder, prompts, 6), strict=True))
    group = replica_factory(folder, {"dp": 2, "tp": 2, "mode": "CAS", "casOverlap": True})
    work = _work(2, prompts, 6)
    _assert_all_equal(group.generate(work), work, want)
    _check_overlap(group, 2, 4, {0, 1})


@pytest.mark.parametrize("value", [True, False])
def test_cas_overlap_is_fixed_while_a_group_runs(value: bool) -> None:
    active = make_policy({"sidp": {"dp": 2, "mode": "CAS", "casOverlap": not value}}).to_proto()
    assert active.sidp.cas_overlap is (not value)
    requested = policy_pb2.Policy(sidp=policy_pb2.SidpPolicy(cas_overlap=value))
    with pytest.raises(InvalidRequestError, match="cas_overlap") as err:
        live_update(active, requested)
    assert err.value.field == "sidp.cas_overlap"


def test_cas_overlap_defaults_to_off() -> None:
    assert make_policy({"sidp": {"dp": 2}}).to_proto().sidp.cas_overlap is False


def test_overlap_without_dummy_skipping(tiny_checkpoint, replica_factory):  # noqa: F811
    # The idle replica sends one zero row per layer it does not own; the busy ones send halves.
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=5)
    prompts = _prompts(3)
    want = dict(zip(map(tuple, prompts), _reference(folder, prompts, 6), strict=True))
    sidp = {"dp": 3, "mode": "CAS", "casOverlap": True, "dummySkipping": False}
    group = replica_factory(folder, sidp)
    work = _work(3, prompts, 6, idle={2})
    _assert_all_equal(group.generate(work), work, want)
    _check_overlap(group, 3, 5, {0, 1})
    assert all(group.stats(r)["policy"]["sidp_skipped_dummies"] == 0 for r in range(3))


@pytest.mark.parametrize("value", ["yes", 1])
def test_a_cas_overlap_that_is_not_a_bool_is_refused_naming_it(value: object) -> None:
    with pytest.raises(InvalidRequestError, match="casOverlap"):
        make_policy({"sidp": {"dp": 2, "casOverlap": value}})
