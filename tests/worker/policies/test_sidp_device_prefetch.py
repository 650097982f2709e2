"""WaS's device-side prefetcher (issue 32, item 5), its schedule on CPU: compute gets every remote
layer's weights; every pass queues the same copies into the same slots (what a captured decode
step replays) and nothing of the next pass; a peer-less GPU topology refuses WaS, naming it.
The CUDA streams and events it queues run only on a GPU (tests/worker/policies/test_sidp_gpu.py)."""

from __future__ import annotations

import pytest

from gearshift.worker.errors import InvalidRequestError
from gearshift.worker.policies.sidp.device_prefetch import DEVICE_PREFETCH_ENV, DevicePrefetch
from gearshift.worker.policies.sidp.gpu_topology import check_peer_access
from gearshift.worker.policies.sidp.ownership import Ownership
from tests.worker.policies.test_sidp_housekeeper import LAYOUT, _housekeeper
from tests.worker.policies.test_sidp_replicas import (  # noqa: F401 - the fixture
    _assert_all_equal,
    _prompts,
    _reference,
    _work,
    replica_factory,
)


def _prefetch(dp: int, layers: int, rank: int, slots: int, depth: int, shift: bool):
    prefetch = _housekeeper(dp, layers, rank, slots, depth, shift, cls=DevicePrefetch)
    return Ownership(dp, layers), prefetch.start()


def _pass(prefetch: DevicePrefetch, own: Ownership, rank: int) -> list[float]:
    seen = []
    for layer in range(own.num_layers):
        prefetch.begin_layer(layer)
        if own.owner(layer) == rank:
            continue
        seen.append(float(prefetch.acquire(layer).gate_up[0, 0]))
        assert len(prefetch._filled) <= prefetch.slots
        prefetch.release(layer)
    return seen


@pytest.mark.parametrize(
    ("dp", "rank", "slots", "depth", "shift"),
    [(2, 1, 1, 1, True), (4, 2, 3, 3, True), (4, 2, 2, 1, False), (4, 0, 1, 0, False)],
)
def test_every_pass_gets_its_layers_and_queues_the_same_copies(dp, rank, slots, depth, shift):
    layers = 2 * dp + 1
    own, prefetch = _prefetch(dp, layers, rank, slots, depth, shift)
    per_pass = []
    for _ in range(3):
        start = len(prefetch.log)
        assert _pass(prefetch, own, rank) == [float(layer) for layer in own.remote(rank)]
        per_pass.append(prefetch.log[start:])
        # Nothing of the next pass is queued: every copy a step forks is joined in that step.
        assert prefetch._filled == {}
    assert per_pass[0] == per_pass[1] == per_pass[2]
    remote = len(own.remote(rank))
    assert prefetch.stats.fetches == 3 * remote
    assert prefetch.stats.fetched_bytes == 3 * remote * LAYOUT.numel * 4
    prefetch.close()


def test_the_window_queues_ahead_of_compute_but_no_further_than_its_depth():
    _, prefetch = _prefetch(4, 8, rank=1, slots=3, depth=3, shift=True)
    prefetch.begin_layer(0)
    # Rank 1's first cycle in its shifted order (2, 3, 0): queued at once, the slots now full.
    assert sorted(prefetch._filled) == [0, 2, 3] and prefetch.stats.slot_waits == 0
    _, shallow = _prefetch(4, 8, rank=1, slots=3, depth=0, shift=False)
    shallow.begin_layer(0)
    assert sorted(shallow._filled) == [0]  # depth 0: only the layer compute is at


def test_a_gpu_without_peer_access_to_an_owner_refuses_was_naming_the_topology():
    links = {(0, 1), (1, 0)}  # GPUs 0 and 1 see each other; GPU 2 sees nobody

    def can_access(a: int, b: int) -> bool:
        return (a, b) in links

    check_peer_access(0, {0, 1}, [0, 1, 2], can_access)  # its owners are reachable
    with pytest.raises(InvalidRequestError) as err:
        check_peer_access(0, {1, 2}, [0, 1, 2], can_access)
    assert err.value.field == "policy.sidp.mode"
    assert "GPU 0 has no peer access to GPU 2" in err.value.message
    assert "0->1 yes" in err.value.message and "2->0 no" in err.value.message
    assert "use mode CAS" in err.value.message


def test_replicas_on_the_device_side_schedule_match_the_reference(
    tiny_checkpoint,
    replica_factory,  # noqa: F811
    monkeypatch,
):
    # The prefetcher a GPU replica runs, forced on CPU: its schedule through real WaS steps.
    monkeypatch.setenv(DEVICE_PREFETCH_ENV, "1")
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=5)
    prompts = _prompts(4)
    want = dict(zip(map(tuple, prompts), _reference(folder, prompts, 8), strict=True))
    group = replica_factory(folder, {"dp": 3, "mode": "WAS", "wasCacheSlots": 2})
    work = _work(3, prompts, 8)
    _assert_all_equal(group.generate(work), work, want)
    for r in range(3):
        stats = group.stats(r)["policy"]
        assert stats["sidp_fetched_weight_bytes"] > 0 and stats["sidp_cas_fused_rows"] == 0
