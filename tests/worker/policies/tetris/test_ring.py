"""Zig-zag ring attention (Tetris §2.3) over 2, 3 and 4 gloo ranks equals single-process causal
attention in fp32 (GQA, MQA, even and uneven lengths, with and without history spread over the
ring), and a ring over a subset of a group's ranks works without creating a group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gearshift.worker.comm import CommGroup
from gearshift.worker.launch.processes import run_ranks
from gearshift.worker.policies.tetris.ring import History, Ring, ring_attention_with_history
from gearshift.worker.policies.tetris.zigzag import ZigZag, even_split
from tests.worker.policies.tetris import ring_driver

TOL = 2e-5  # fp32 against a float64 reference


def _run_world(world: int, tmp: Path) -> dict[int, dict[str, dict[str, float]]]:
    args = (world, str(tmp / "store"), str(tmp))
    codes = run_ranks(ring_driver.run_rank, [(r, *args) for r in range(world)], "ring", 240)
    assert codes == [0] * world, "a rank failed or hung"
    return {r: json.loads((tmp / f"rank-{r}.json").read_text()) for r in range(world)}


@pytest.fixture(scope="module")
def ring_results(tmp_path_factory: pytest.TempPathFactory):
    cache: dict[int, dict[int, dict[str, dict[str, float]]]] = {}

    def get(world: int) -> dict[int, dict[str, dict[str, float]]]:
        if world not in cache:
            cache[world] = _run_world(world, tmp_path_factory.mktemp(f"ring{world}"))
        return cache[world]

    return get


# Two ranks in the quick loop; 3 and 4 (each a set of spawned gloo processes) in the full suite.
@pytest.mark.parametrize(
    "world", [2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)]
)
def test_ring_attention_equals_single_process_attention(world, ring_results):
    results = ring_results(world)
    for case in ring_driver.cases(world):
        if case.name.startswith("subset") or ring_driver.pool_case(case):
            continue
        for rank in case.members:
            got = results[rank][case.name]
            assert got["out_err"] < TOL and got["lse_err"] < TOL, (case, rank, got)
        # Every chunk row was computed by exactly one member.
        assert sum(results[r][case.name]["rows"] for r in case.members) == case.length


@pytest.mark.slow
def test_a_ring_over_a_subset_of_the_group_needs_no_new_group(ring_results):
    results = ring_results(3)
    for case in ring_driver.cases(3):
        if not case.name.startswith("subset"):
            continue
        assert case.name not in results[1], "rank 1 is not in the ring and must not take part"
        for rank in case.members:
            got = results[rank][case.name]
            assert got["out_err"] < TOL and got["lse_err"] < TOL, (case, rank, got)


@pytest.mark.slow
def test_a_ring_in_a_pool_group_maps_group_ranks_to_global_ranks(ring_results):
    # Pool group = global ranks 1, 2, 3; ring members are group ranks 2 and 0 = global 3 and 1.
    results = ring_results(4)
    case = next(c for c in ring_driver.cases(4) if ring_driver.pool_case(c))
    assert case.name not in results[0] and case.name not in results[2], "not ring members"
    for rank in (1, 3):
        got = results[rank][case.name]
        assert got["out_err"] < TOL and got["lse_err"] < TOL, (rank, got)
    assert results[1][case.name]["rows"] + results[3][case.name]["rows"] == case.length


def test_a_one_member_ring_is_plain_causal_attention_with_history():
    case = ring_driver.Case("one", (0,), 9, 4, 6, 3)
    q, k, v, want_out, want_lse = ring_driver.reference(case, seed=3)
    ring = Ring(CommGroup.single(), (0,))
    history = History(k[:4].float(), v[:4].float(), (4,))
    out, lse = ring_attention_with_history(
        q.float(), k[4:].float(), v[4:].float(), history, ring, ZigZag(9, 1), ring_driver.D**-0.5
    )
    torch.testing.assert_close(out.double(), want_out, atol=TOL, rtol=0)
    torch.testing.assert_close(lse.double(), want_lse, atol=TOL, rtol=0)


@pytest.mark.parametrize("length,members", [(16, 2), (23, 3), (5, 4), (0, 2), (40, 4)])
def test_zigzag_shards_cover_the_chunk_and_balance_causal_work(length, members):
    layout = ZigZag(length, members)
    rows = torch.arange(length)
    parts = [layout.split(rows, m) for m in range(members)]
    assert torch.equal(layout.join(parts), rows)
    assert sorted(p for m in range(members) for p in layout.positions(m)) == list(range(length))
    assert [layout.split(rows, m).tolist() for m in range(members)] == [
        layout.positions(m) for m in range(members)
    ]
    # Member i holds shards i and 2N-1-i; sizes differ by at most one token per shard.
    sizes = [hi - lo for lo, hi in zip(layout.bounds, layout.bounds[1:], strict=False)]
    assert max(sizes) - min(sizes) <= 1
    assert (
        max(map(layout.local_length, range(members)))
        - min(map(layout.local_length, range(members)))
        <= 1
    )
    # Causal work (query-key pairs inside the chunk): equal when 2N divides the length, else
    # within what the few extra tokens add.
    work = [sum(p + 1 for p in layout.positions(m)) for m in range(members)]
    assert max(work) - min(work) <= (0 if length % (2 * members) == 0 else 2 * length)


def test_even_split_spreads_history_within_one_token():
    assert even_split(7, 3) == (3, 2, 2)
    assert even_split(2, 4) == (1, 1, 0, 0)
    assert sum(even_split(1001, 7)) == 1001


def test_ring_refuses_members_that_are_not_a_ring_of_the_group():
    comm = CommGroup(3, 1, (0, 1, 2))
    with pytest.raises(ValueError, match="not in ring"):
        Ring(comm, (0, 2))
    with pytest.raises(ValueError, match="distinct"):
        Ring(comm, (1, 1))
    with pytest.raises(ValueError, match="outside"):
        Ring(comm, (1, 3))
