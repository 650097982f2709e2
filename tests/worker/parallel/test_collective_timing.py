"""Timing a group's collectives (worker/parallel/collective_timing.py): in a real 3-rank gloo
group of spawned processes every collective is timed at every size and every rank reports the
same (slowest-rank) figures; the control channel's request packs into int64s and is refused
when malformed; each layout names the collectives it runs."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from gearshift.worker.launch.processes import rank_context, start_rank
from gearshift.worker.parallel.collective_timing import COLLECTIVES, CollectiveRequest
from gearshift.worker.parallel.layout import Layout

WAIT_S = 60.0
SIZES = (4096, 4 << 20)


def _rank_main(rank: int, world: int, store: str, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from gearshift.worker.comm import CommGroup
    from gearshift.worker.parallel.collective_timing import time_collectives

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, world),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=WAIT_S),
    )
    try:
        request = CollectiveRequest(COLLECTIVES, SIZES, 3, 30)
        group = CommGroup(world, rank, tuple(range(world)))
        out.put((rank, time_collectives(request, group, torch.device("cpu"))))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out.put((rank, f"{type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # three ranks timing every collective: about 3 s, more on a loaded host
def test_every_collective_is_timed_in_a_three_rank_group(tmp_path: Path) -> None:
    ctx = rank_context()  # the suite's fork server: torch imported once, not once a rank
    out = ctx.Queue()
    world = 3
    args = [(r, world, str(tmp_path / "store"), out) for r in range(world)]
    procs = [start_rank(ctx, _rank_main, a, f"timing-{r}") for r, a in enumerate(args)]
    try:
        got = dict(out.get(timeout=WAIT_S * 2) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(10)
    assert all(isinstance(v, dict) for v in got.values()), got
    assert got[0] == got[1] == got[2]  # the slowest rank's time, agreed by every rank
    assert set(got[0]) == set(COLLECTIVES)
    for name, points in got[0].items():
        sizes = [b for b, _ in points]
        # Rounded down to whole float32 elements per rank: multiples of 3 x 4 bytes.
        assert sizes == [b - b % 12 for b in SIZES], (name, sizes)
        # Only that each point was measured: which size is slower is a timing, and timings
        # belong in benchmarks/ (a loaded host once measured 4 KiB slower than 4 MiB).
        assert all(t > 0 for _, t in points)


def test_a_request_survives_its_int64_packing() -> None:
    req = CollectiveRequest(("send_recv", "all_reduce"), (4096, 1 << 24), 5, 30)
    assert CollectiveRequest.unpack(req.pack()) == req


@pytest.mark.parametrize(
    ("names", "sizes", "repeats", "named"),
    [
        (("broadcast",), (4096,), 1, "collectives: 'broadcast'"),
        (("all_reduce",), (), 1, "collective sizes"),
        (("all_reduce",), (0,), 1, "collective sizes"),
        (("all_reduce",), (4096,), 0, "collective repeats"),
    ],
)
def test_a_malformed_request_is_refused(
    names: tuple[str, ...], sizes: tuple[int, ...], repeats: int, named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        CollectiveRequest(names, sizes, repeats)


def test_each_layout_names_the_collectives_its_steps_run() -> None:
    assert Layout().collectives() == ()
    assert Layout(tp=2).collectives() == ("all_reduce",)
    assert Layout(sp=2).collectives() == ("all_to_all", "all_gather")
    assert Layout(pp=2).collectives() == ("send_recv",)
    assert Layout(sp=2, tp=2, pp=2).collectives() == (
        "all_reduce",
        "all_to_all",
        "all_gather",
        "send_recv",
    )
