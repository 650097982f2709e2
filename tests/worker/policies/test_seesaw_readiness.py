"""Seesaw §5.2 swap-in readiness, seen in the plans: resident sequences keep decoding while
another sequence's swap-in is outstanding, and no sequence is in a plan before every rank has
reported its copies; a rank SIGKILLed with a swap-in outstanding ends the group naming it."""

from __future__ import annotations

import mmap
import os
import signal
import struct
import time

from gearshift.worker.engine.plan import StepPlan
from gearshift.worker.policies.seesaw.host_kv import SHM_DIR
from gearshift.worker.policies.seesaw.policy import PREFETCH_HOLD_ENV
from gearshift.worker.policies.seesaw.rank_hook import SWAP_IN
from gearshift.worker.sampling.params import SamplingParams
from tests.worker.policies.test_seesaw import (
    BLOCK,
    DEVICE_KV,
    ENGINE,
    _model,
    _prompts,
    _reference,
    _seesaw,
    no_leftover_segments,  # noqa: F401 - a fixture
)
from tests.worker.policies.test_seesaw_ops import _alive, _segments, _start

P2, T2 = {"tp": 1, "pp": 2}, {"tp": 2, "pp": 1}


def _blocks_touched(plan: StepPlan) -> set[int]:
    """Device blocks a plan's forward reads (each sequence's table up to its length) or writes."""
    touched = {int(s) // BLOCK for s in plan.slot_mapping.tolist() if s >= 0}
    for row, length in zip(plan.block_tables, plan.seq_lens.tolist(), strict=True):
        touched |= set(row[: -(-length // BLOCK)].tolist())
    return touched


def test_resident_sequences_decode_while_a_swap_in_is_outstanding_and_none_runs_before_ready(
    no_leftover_segments,  # noqa: F811
    monkeypatch,
    tiny_checkpoint,
    group_factory,
    engine_factory,
):
    # Each rank reports a swap-in only after it has begun two more plans: whatever runs in
    # those plans runs while the swap-in is outstanding on that rank.
    monkeypatch.setenv(PREFETCH_HOLD_ENV, "2")
    folder = _model(tiny_checkpoint)
    prompts = _prompts(10)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = _reference(engine_factory, folder, prompts, params)
    # One sequence per swap-in, so sequences are on-boarded one by one as blocks free.
    policy = _seesaw(P2, T2, prefetchMaxSequences=1)
    engine = group_factory(folder, policy, kv_cache_bytes=DEVICE_KV, **ENGINE)
    assert [o.token_ids for o in engine.generate(prompts, params)] == want

    plans = engine.executor.submitted
    lead = engine.policy.leader
    sent = {e.ticket: e for e in lead.queue.log if e.what == "sent"}
    ready = {e.ticket: e for e in lead.queue.log if e.what == "ready"}
    assert len(sent) >= 3 and sent.keys() == ready.keys()
    overlapped = []
    for ticket, s in sent.items():
        r = ready[ticket]
        section = plans[s.plan].section(SWAP_IN)
        assert section is not None and int(section[0]) == ticket
        blocks = set(section[1:].view(-1, 2)[:, 1].tolist())
        # Ready only once every rank's slot on the board had reached the ticket.
        assert r.plan > s.plan and min(r.board[1:]) >= ticket, (s, r)
        # No plan from the one that starts the copies until readiness touches those blocks...
        for k in range(s.plan, r.plan):
            assert not _blocks_touched(plans[k]) & blocks, (ticket, k)
        # ...and the sequence decodes from the plan after readiness on.
        assert any(_blocks_touched(p) & blocks for p in plans[r.plan :])
        overlapped += [k for k in range(s.plan + 1, r.plan) if plans[k].num_decodes]
    # Decode steps of resident sequences were launched while a swap-in was outstanding.
    assert overlapped, "no decode step ran while a swap-in was outstanding"
    stats = engine.policy.stats()
    assert stats["swap_wait_seconds"] > 0 and stats["swap_waiting_sequences"] == 0
    assert not lead.queue.busy


def _board(view: mmap.mmap) -> tuple[int, int, int]:
    """(last ticket sent, rank 0's last finished, rank 1's): the segment's last 24 bytes."""
    sent, r0, r1 = struct.unpack("<3q", view[-24:])
    return sent, r0, r1


def test_sigkill_of_a_rank_with_a_swap_in_outstanding_ends_the_group_naming_it(tiny_checkpoint):
    folder = _model(tiny_checkpoint)
    tag = f"killin{os.getpid()}"
    # Reports wait for 20 more plans: the follower has a swap-in outstanding most of the time.
    proc, followers = _start(folder, tag, **{PREFETCH_HOLD_ENV: "20"})
    view = None
    try:
        assert len(followers) == 1, "the group did not start"
        (segment,) = _segments(tag)
        with open(SHM_DIR / segment, "rb") as f:
            view = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        outstanding = 0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            sent, _, r1 = _board(view)
            if sent > r1:
                os.kill(followers[0], signal.SIGKILL)
                outstanding = sent
                break
            time.sleep(0.001)
        assert outstanding, "no swap-in was ever outstanding"
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in followers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in followers), "a rank outlived its group"
    # The dead rank never reported the swap-in it was copying.
    assert _board(view)[2] < outstanding
    view.close()
    # 4: the driver saw the engine report the failure; 3 (EXIT_PEER_FAILED): the leader's
    # watchdog missed rank 1's heartbeat first and ended the process. Either names rank 1.
    assert proc.returncode in (4, 3) and "rank 1" in err, err[-2000:]
    assert _segments(tag) == [], "the leader did not unlink its segment"


def test_a_sequence_aborted_mid_swap_in_frees_its_blocks_only_after_every_copy_is_done(
    no_leftover_segments,  # noqa: F811
    monkeypatch,
    tiny_checkpoint,
    group_factory,
    engine_factory,
):
    monkeypatch.setenv(PREFETCH_HOLD_ENV, "3")  # copies stay outstanding for three plans
    folder = _model(tiny_checkpoint)
    prompts = _prompts(10)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = _reference(engine_factory, folder, prompts, params)
    policy = _seesaw(P2, T2, prefetchMaxSequences=1)
    engine = group_factory(folder, policy, kv_cache_bytes=DEVICE_KV, **ENGINE)
    lead = engine.policy.leader
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    victim, blocks, aborted_at = "", set(), 0
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
        if not victim and lead.queue.pending:
            victim, pending = next(iter(lead.queue.pending.items()))
            blocks, aborted_at = set(pending.blocks), len(engine.executor.submitted)
            assert engine.abort_request(victim)
    assert victim, "no sequence was ever being swapped in"
    (retired,) = [e for e in lead.queue.log if e.what == "retired"]
    assert retired.request_ids == (victim,) and min(retired.board[1:]) >= retired.ticket
    assert retired.plan > aborted_at  # the copies outlived the abort: plans ran meanwhile
    plans = engine.executor.submitted
    # Its blocks went to no one until every rank had finished copying into them.
    for k in range(aborted_at, retired.plan):
        assert not _blocks_touched(plans[k]) & blocks, k
    del got[victim]
    assert got == {rid: want[int(rid[1:])] for rid in got}  # no one read a stale copy
    assert lead.pages.used == 0 and not lead.queue.busy
    assert engine.blocks.leaked_blocks() == []
