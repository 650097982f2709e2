"""The control channel's request to time collectives (worker/parallel/collective_timing.py):
packed and unpacked as int64s, refused when malformed, and which collectives each layout runs."""

from __future__ import annotations

import pytest

from gearshift.worker.parallel.collective_timing import CollectiveRequest
from gearshift.worker.parallel.layout import Layout


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
