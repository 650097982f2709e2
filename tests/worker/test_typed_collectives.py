"""Typed messages over torch.distributed (worker/typed_collectives.py), in real gloo groups of
spawned processes: messages gather and broadcast exactly, and a rank that sends a pickle (or a
length out of bounds) fails every rank with a GroupFailure naming it; nothing is unpickled."""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from gearshift.worker.launch.processes import rank_context, start_rank
from gearshift.worker.wire import Codec
from tests.worker.policies.tetris.test_tetris_messages import live_pickle

WAIT_S = 60.0


@dataclass(frozen=True)
class Note:
    rank: int
    text: str
    blob: bytes


NOTES: Codec[Note] = Codec([Note])


def _rank_main(rank: int, world: int, store: str, case: str, payload: bytes, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from gearshift.worker import typed_collectives as tc

    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, world),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=WAIT_S),
    )
    try:
        mine = Note(rank, "é" * rank, bytes(range(rank * 7)) or b"\x00")
        if case == "exact":
            got: Any = tc.all_gather_message(NOTES, mine)
            got.append(tc.broadcast_message(NOTES, mine if rank == 1 else None, src=1))
        elif case == "pickle" and rank == 1:  # what all_gather_object would have sent
            got = tc.all_gather_bytes(payload)
        elif case == "oversize" and rank == 1:  # a hostile peer's length, sent by hand
            lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
            dist.all_gather(lengths, torch.tensor([(1 << 20) + 1]))
            got = None
        elif case == "pickle-broadcast":
            got = (
                tc.broadcast_bytes(payload, 0)
                if rank == 0
                else tc.broadcast_message(NOTES, None, 0)
            )
        else:  # "pickle" and "oversize" on the other ranks
            got = tc.all_gather_message(NOTES, mine, what="notes")
        out.put((rank, "ok", got))
    except Exception as exc:  # noqa: BLE001 - reported to the test, which checks the kind
        out.put((rank, type(exc).__name__, str(exc) or traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _run(tmp_path: Path, world: int, case: str, payload: bytes = b"") -> dict[int, tuple[str, Any]]:
    # The suite's fork server (torch imported once a test process), not spawn: each spawned
    # rank imported torch again, over 2 s of CPU.
    ctx = rank_context()
    out = ctx.Queue()
    store = str(tmp_path / f"store-{case}")
    args = [(r, world, store, case, payload, out) for r in range(world)]
    procs = [start_rank(ctx, _rank_main, a, f"typed-{case}-{r}") for r, a in enumerate(args)]
    try:
        results = [out.get(timeout=WAIT_S * 2) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(10)
    return {r: (kind, value) for r, kind, value in results}


def test_every_rank_gets_every_ranks_message_in_rank_order_and_the_broadcast(
    tmp_path: Path,
) -> None:
    want = [Note(r, "é" * r, bytes(range(r * 7)) or b"\x00") for r in range(3)]
    got = _run(tmp_path, 3, "exact")
    assert got == {r: ("ok", [*want, want[1]]) for r in range(3)}


def test_a_pickle_from_a_peer_is_refused_naming_it_and_never_loaded(tmp_path: Path) -> None:
    payload, target = live_pickle(tmp_path)
    got = _run(tmp_path, 3, "pickle", payload)
    for r in (0, 2):
        kind, message = got[r]
        assert kind == "GroupFailure", message
        assert "notes from group rank 1 refused: not a message" in message
    assert got[1][0] == "ok" and got[1][1][1] == payload  # it got the raw bytes, nothing more
    got = _run(tmp_path, 2, "pickle-broadcast", payload)
    assert got[1][0] == "GroupFailure" and "from rank 0 refused" in got[1][1]
    assert not target.exists(), "a rank unpickled what a peer sent"


def test_a_length_out_of_bounds_is_refused_before_anything_is_allocated(tmp_path: Path) -> None:
    got = _run(tmp_path, 3, "oversize")
    for r in (0, 2):
        kind, message = got[r]
        assert kind == "GroupFailure", message
        assert "notes: group rank 1 announced 1048577 bytes (1 to 1048576 allowed)" in message


def test_a_message_over_the_limit_is_refused_before_it_is_sent(tmp_path: Path) -> None:
    from gearshift.worker.errors import GroupFailure
    from gearshift.worker.typed_collectives import all_gather_bytes

    with pytest.raises(GroupFailure, match="this rank announced 0 bytes"):
        all_gather_bytes(b"")  # refused before any collective: no group needed
