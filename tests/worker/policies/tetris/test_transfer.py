"""The decode side's transfer-slot handshake (Tetris §4.2): first-handshake order under a
shortage of slots, every request finishes, aborts and time-outs free everything."""

from __future__ import annotations

import threading
import time

import pytest

from gearshift.worker.policies.tetris.transfer import ReceiveManager, TransferError


def _wait(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def test_with_fewer_slots_than_senders_requests_are_served_in_first_handshake_order():
    manager = ReceiveManager(slots=2)
    manager.announce("blocker", pieces=2, rows=10)
    manager.acquire("blocker", 5)
    manager.acquire("blocker", 5)  # both slots taken: everyone below has to queue
    requests = [f"r{i}" for i in range(6)]
    for rid in requests:  # the first handshakes, in this order
        manager.announce(rid, pieces=3, rows=100)
    assert manager.virtual_rows == 10 + 600
    errors: list[BaseException] = []

    def send_piece(rid: str) -> None:
        try:
            manager.acquire(rid, timeout_s=60)
            time.sleep(0.002)  # the transfer itself
            manager.landed(rid)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    # Three prefill members per request, started newest request first.
    threads = [
        threading.Thread(target=send_piece, args=(rid,))
        for rid in reversed(requests)
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    _wait(lambda: manager.waiting_handshakes == 18, "every handshake to queue")
    manager.landed("blocker")
    manager.landed("blocker")
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    # A started request keeps its priority until all its pieces landed: no interleaving.
    assert manager.grants[2:] == [rid for rid in requests for _ in range(3)]
    assert manager.take_ready() == ["blocker", *requests]
    assert manager.free_slots == 2 and manager.virtual_rows == 0 and manager.in_transfer == 0


def test_a_handshake_waits_a_bounded_time_and_aborts_free_slots_and_usage():
    manager = ReceiveManager(slots=1)
    manager.announce("a", pieces=2, rows=7)
    manager.announce("b", pieces=1, rows=5)
    manager.acquire("a", 1)
    with pytest.raises(TransferError, match="no transfer slot within"):
        manager.acquire("b", timeout_s=0.2)
    failed: list[BaseException] = []
    waiter = threading.Thread(
        target=lambda: failed.append(_raises(lambda: manager.acquire("b", timeout_s=30)))
    )
    waiter.start()
    _wait(lambda: manager.waiting_handshakes == 1, "b to queue")
    manager.abort("b")  # its waiting handshake fails at once
    waiter.join(timeout=30)
    assert isinstance(failed[0], TransferError) and "aborted" in str(failed[0])
    manager.abort("a")  # holding a slot: it comes back
    assert manager.free_slots == 1 and manager.virtual_rows == 0 and manager.in_transfer == 0
    assert manager.take_ready() == []


def test_pieces_beyond_the_announced_ones_and_unknown_requests_are_refused():
    manager = ReceiveManager(slots=2)
    with pytest.raises(TransferError, match="no handshake announced"):
        manager.acquire("x", 1)
    manager.announce("x", pieces=1, rows=3)
    manager.acquire("x", 1)
    with pytest.raises(TransferError, match="more pieces than the 1 announced"):
        manager.acquire("x", 1)
    manager.landed("x")
    with pytest.raises(ValueError, match="at least one transfer slot"):
        ReceiveManager(slots=0)


def _raises(call) -> BaseException | None:
    try:
        call()
    except BaseException as exc:  # noqa: BLE001
        return exc
    return None


def test_stream_sections_round_trip_posts_and_completes() -> None:
    from gearshift.worker.policies.tetris.admission import decode_stream, encode_stream

    posts = [(0, 1, 3, 12), (1, 0, 4, 5)]  # (src, slot, grant number, rows)
    completes = [(1, [7, 2, 9]), (2, [])]
    assert decode_stream(encode_stream(posts, completes)) == (posts, completes)
    assert decode_stream(encode_stream([], [])) == ([], [])


def test_granted_pieces_hold_distinct_slots_and_a_landed_slot_is_granted_again() -> None:
    """A granted piece travels on its slot's channel (handoff.py): two pieces in flight never
    share one, and the slot a piece landed on is the one the next grant gets."""
    manager = ReceiveManager(slots=2)
    manager.announce("a", pieces=3, rows=30)
    first, second = manager.acquire("a", 1), manager.acquire("a", 1)
    assert {first, second} == {0, 1}
    manager.landed("a", second)
    assert manager.acquire("a", 1) == second
    with pytest.raises(TransferError, match="without a slot"):
        manager.landed("a", 5)
