"""A serving Tetris group (real processes, gloo, fp32) against the single-process reference.

The prefill pool runs each request's chunk plan (one chunk, growing groups 1 -> 2, several
transfer-buffer pieces per member), hands the KV to a TP-2 decode instance through the
handshake, and the decode instance admits it into continuous batching: greedy tokens equal the
one-process engine's. Bad plans are refused naming the field; a killed prefill instance fails
only its requests; no KV block, transfer slot or process is left behind.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gearshift.v1 import worker_pb2
from gearshift.worker.config import EngineConfig
from gearshift.worker.engine.llm_engine import EngineStats
from gearshift.worker.engine.outputs import RequestOutput
from gearshift.worker.errors import GroupFailure, InvalidRequestError
from gearshift.worker.launch import start_engine
from gearshift.worker.launch.group_config import GroupConfig
from gearshift.worker.launch.tetris.controller import TetrisGroup
from gearshift.worker.launch.tetris.messages import Snapshot
from gearshift.worker.launch.tetris.start import start_tetris
from gearshift.worker.launch.tetris.state import pieces_of
from gearshift.worker.policies.registry import make_policy
from gearshift.worker.sampling.params import SamplingParams
from gearshift.worker.server.convert import worker_stats

ENGINE: dict[str, Any] = {
    "dtype": "float32",
    "kv_cache_bytes": 4 << 20,
    "skip_tokenizer_init": True,
    "block_size": 4,
    "max_num_batched_tokens": 64,
}
TIMEOUT_S = 120.0


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _prompts(lengths: list[int], vocab: int = 128, seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _plan(chunks: list[tuple[int, list[int]]], decode: int = 0) -> worker_pb2.TetrisPlan:
    plan = worker_pb2.TetrisPlan(decode_instance=decode, planned_prefill_seconds=0.5)
    for n, group in chunks:
        plan.chunks.add(num_tokens=n, prefill_instances=group)
    return plan


class Outputs:
    """What the group delivers, per request."""

    def __init__(self) -> None:
        self.items: queue.Queue[tuple[str, RequestOutput | BaseException]] = queue.Queue()
        self.seen: dict[str, list[Any]] = {}

    def __call__(self, rid: str, item: RequestOutput | BaseException) -> None:
        self.items.put((rid, item))

    def _ended(self, rid: str) -> bool:
        items = self.seen.get(rid, [])
        return bool(items) and (isinstance(items[-1], BaseException) or items[-1].finished)

    def collect(self, rids: set[str], timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
        """Each request's tokens (a list), or the exception that ended it; outputs of other
        requests wait for their own ``collect``."""
        deadline = time.monotonic() + timeout_s
        while not all(self._ended(rid) for rid in rids):
            rid, item = self.items.get(timeout=max(0.1, deadline - time.monotonic()))
            self.seen.setdefault(rid, []).append(item)
        out: dict[str, Any] = {}
        for rid in rids:
            items = self.seen.pop(rid)
            if isinstance(items[-1], BaseException):
                out[rid] = items[-1]
                continue
            assert items[-1].error is None, items[-1].error
            out[rid] = [t for o in items for t in o.new_token_ids]
        return out


@pytest.fixture
def tetris_factory() -> Iterator[Callable[..., tuple[TetrisGroup, Outputs]]]:
    groups: list[TetrisGroup] = []

    def start(folder: Path, tetris: dict[str, Any], **kw: Any) -> tuple[TetrisGroup, Outputs]:
        outputs = Outputs()
        config = EngineConfig(model=str(folder), **{**ENGINE, "kv_cache_bytes": 64 << 20, **kw})
        policy = make_policy({"tetris": tetris})
        group = start_tetris(config, policy, GroupConfig(timeout_s=TIMEOUT_S), outputs)  # type: ignore[arg-type]
        groups.append(group)
        return group, outputs

    yield start
    for group in groups:
        slots = [m.free_slots == m.slots and m.in_transfer == 0 for m in group.managers]
        reports = group.shutdown()
        assert all(slots), "a transfer slot was left held"
        assert reports and all(r["leaked_blocks"] == 0 and r["all_free"] for r in reports), reports
        assert all(r["posted_receives"] == 0 for r in reports), reports
        assert all(not p.is_alive() for p in group.procs), "a rank outlived its group"


def _reference(folder: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    engine = start_engine(EngineConfig(model=str(folder), **ENGINE))
    try:
        return [o.token_ids for o in engine.generate(prompts, _greedy(max_tokens))]
    finally:
        engine.shutdown()


def test_decode_instances_report_their_kv_room_and_what_they_hold_when_empty() -> None:
    """The router's planner view (WorkerStats.instances): free slots count the blocks reserved
    for requests in transfer, reported apart; ``kv_slots_total`` (the blocks times the block
    size) lets the router refuse at once only what no decode instance could ever hold, and a
    decode instance not heard from yet reports 0 there (unknown)."""
    policy = make_policy({"tetris": {"prefill_instances": 2, "decode_instances": 2}})
    group = TetrisGroup(policy, [], [], [], None, 1.0, lambda *_: None)  # type: ignore[arg-type]
    group.snapshots = [Snapshot(EngineStats(3, 0, 64, 10, 10 / 64, 0, 0, 0, 0, 0, 0), 32, 16), None]
    loads = {(i.role, i.index): i for i in group.instances()}
    busy, unheard = loads[("decode", 0)], loads[("decode", 1)]
    assert (busy.kv_slots_free, busy.kv_slots_reserved, busy.batch_size) == (54 * 16 + 32, 32, 3)
    assert busy.kv_slots_total == 64 * 16 and unheard.kv_slots_total == 0
    assert loads[("prefill", 0)].kv_slots_total == 0
    # ... and GetStats carries it (InstanceStats.kv_slots_total).
    empty = EngineStats(0, 0, 0, 0, 0.0, 0, 0, 0, 0, 0, 0, instances=group.instances())
    wire = worker_stats(
        empty, model="m", max_model_len=1, policy=policy.to_proto(), ranks=4, revision=""
    )
    decode = [i for i in wire.instances if i.role == worker_pb2.InstanceStats.DECODE]
    assert [i.kv_slots_total for i in decode] == [64 * 16, 0]


def test_pieces_cut_each_members_rows_at_the_buffer() -> None:
    assert pieces_of({0: 10, 1: 0, 2: 3}, row_bytes=100, buffer_bytes=400) == {
        0: [(0, 4), (4, 4), (8, 2)],
        2: [(0, 3)],
    }
    assert pieces_of({0: 2}, row_bytes=1000, buffer_bytes=10) == {0: [(0, 1), (1, 1)]}


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_chunk_plans_hand_over_to_a_tp2_decode_instance_with_one_process_tokens(
    tiny_checkpoint: Callable[..., Path],
    tetris_factory: Callable[..., tuple[TetrisGroup, Outputs]],
    layerwise: bool,
) -> None:
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=2)
    prompts = _prompts([37, 23, 9, 30])
    expected = _reference(folder, prompts, 6)
    # Two slots for two senders, and pieces of about 5 rows: several handshakes per member.
    group, outputs = tetris_factory(
        folder,
        {
            "prefill_instances": 2,
            "decode_instances": 1,
            "decode_tp": 2,
            "transfer_backends": 1,
            "transfer_buffer_bytes": 5 * 2 * 2 * 1 * 8 * 4,
            "layerwise_transfer": layerwise,
        },
    )
    plans = [
        _plan([(16, [0]), (21, [0, 1])]),  # 1 -> 2 instances
        _plan([(23, [1])]),  # one chunk on one instance
        None,  # no router plan: one chunk over the pool
        _plan([(8, [1]), (22, [1, 0])]),
    ]
    for i, (ids, plan) in enumerate(zip(prompts, plans, strict=True)):
        group.submit(f"r{i}", ids, _greedy(6), plan)
    got = outputs.collect({f"r{i}" for i in range(4)})
    assert [got[f"r{i}"] for i in range(4)] == expected
    stats = group.stats()
    assert stats["prefills"] == 4
    assert stats["transfer_waits"] > 8  # several pieces per member, each with a handshake
    assert group.managers[0].grants  # granted in first-handshake order (transfer.py's tests)


def test_a_gpu_the_host_lacks_is_refused_naming_device_before_any_rank_starts(
    tiny_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``cuda`` and ``cuda:N`` are accepted as for every policy (one GPU per local rank, or
    every rank on GPU N); a rank with no GPU to take is refused before any process starts."""
    import multiprocessing

    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # 3 ranks, 2 GPUs
    policy = make_policy({"tetris": {"prefill_instances": 2, "decode_instances": 1}})
    before = set(multiprocessing.active_children())
    for device, gpu in (("cuda", "GPU 2"), ("cuda:5", "GPU 5")):
        config = EngineConfig(model=str(folder), **{**ENGINE, "device": device})
        with pytest.raises(InvalidRequestError, match=gpu) as info:
            start_tetris(config, policy, GroupConfig(timeout_s=TIMEOUT_S), Outputs())  # type: ignore[arg-type]
        assert info.value.field == "device"
        assert "shows 2" in str(info.value) and "not supported" not in str(info.value)
    assert set(multiprocessing.active_children()) == before, "a rank started"


def test_bad_plans_are_refused_naming_the_field(
    tiny_checkpoint: Callable[..., Path],
    tetris_factory: Callable[..., tuple[TetrisGroup, Outputs]],
) -> None:
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=2)
    group, outputs = tetris_factory(folder, {"prefill_instances": 2, "decode_instances": 1})
    ids = _prompts([12])[0]
    cases = [
        (_plan([(10, [0])]), "tetris_plan"),  # lengths do not add up
        (_plan([(6, [0, 1]), (6, [1])]), "tetris_plan"),  # a group drops a member
        (_plan([(12, [2])]), "tetris_plan"),  # no such instance
        (_plan([(12, [0])], decode=1), "tetris_plan.decode_instance"),
    ]
    for plan, field in cases:
        with pytest.raises(InvalidRequestError) as info:
            group.submit("bad", ids, _greedy(3), plan)
        assert info.value.field == field
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        group.submit("bad", ids, SamplingParams(max_tokens=2, prompt_logprobs=1), None)
    # The decode instance's own checks still apply (max_tokens beyond the context).
    group.submit("long", ids, _greedy(10_000), _plan([(12, [0])]))
    got = outputs.collect({"long"})
    assert isinstance(got["long"], InvalidRequestError) and got["long"].field == "max_tokens"
    # The group still serves.
    group.submit("ok", ids, _greedy(3), _plan([(12, [1])]))
    assert len(outputs.collect({"ok"})["ok"]) == 3


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_aborts_at_any_point_of_the_hand_off_leave_nothing_behind(
    tiny_checkpoint: Callable[..., Path],
    tetris_factory: Callable[..., tuple[TetrisGroup, Outputs]],
    layerwise: bool,
) -> None:
    """Requests aborted while queued, computing, handshaking or mid-transfer (one slot, pieces
    of two rows: many handshakes each): no slot or block stays held (the fixture checks), no
    member is left blocked in a send, and the group serves the next request exactly."""
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=2)
    prompts = _prompts([40, 33, 27, 36, 21, 30], seed=9)
    expected = _reference(folder, prompts[:1], 5)
    group, outputs = tetris_factory(
        folder,
        {
            "prefill_instances": 2,
            "decode_instances": 1,
            "decode_tp": 2,
            "transfer_backends": 1,
            "transfer_buffer_bytes": 2 * 2 * 2 * 1 * 8 * 4,
            "layerwise_transfer": layerwise,
        },
    )
    for i, ids in enumerate(prompts):
        group.submit(
            f"a{i}",
            ids,
            _greedy(5),
            _plan([(len(ids) // 2, [i % 2]), (len(ids) - len(ids) // 2, [i % 2, 1 - i % 2])]),
        )
    aborted = 0
    for i in range(len(prompts)):
        time.sleep(0.03 * i)
        aborted += group.abort(f"a{i}")
    assert aborted >= 1
    deadline = time.monotonic() + TIMEOUT_S
    while any(m.in_transfer or m.free_slots != m.slots for m in group.managers):
        assert time.monotonic() < deadline, "a transfer slot stayed held"
        time.sleep(0.05)
    group.submit("after", prompts[0], _greedy(5), _plan([(40, [1, 0])]))
    assert outputs.collect({"after"})["after"] == expected[0]


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_a_killed_prefill_instance_fails_its_requests_and_decode_keeps_serving(
    tiny_checkpoint: Callable[..., Path],
    tetris_factory: Callable[..., tuple[TetrisGroup, Outputs]],
    layerwise: bool,
) -> None:
    """Layer-wise, the doomed request's pieces are granted (and their receives posted on the
    decode instance) before the kill: the survivor's are filled with zeros and dropped, the dead
    member's fail in gloo, and nothing stays posted (the fixture checks)."""
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=2)
    prompts = _prompts([40, 9])
    expected = _reference(folder, prompts, 4)
    group, outputs = tetris_factory(
        folder,
        {"prefill_instances": 2, "decode_instances": 1, "layerwise_transfer": layerwise},
    )
    # A request decoding on the decode instance must keep going through the failure.
    group.submit("steady", prompts[1], _greedy(40), _plan([(9, [0])]))
    deadline = time.monotonic() + TIMEOUT_S
    while "steady" not in outputs.seen and time.monotonic() < deadline:
        rid, item = outputs.items.get(timeout=TIMEOUT_S)
        outputs.seen.setdefault(rid, []).append(item)
    assert not isinstance(outputs.seen["steady"][0], BaseException)
    # Instance 1 runs chunk 1 alone, then waits in chunk 2's ring for instance 0, which is
    # stopped: it is mid-chunk for certain when it is killed.
    keeper, victim = group.procs[0], group.procs[1]
    os.kill(keeper.pid, signal.SIGSTOP)
    try:
        group.submit("doomed", prompts[0], _greedy(4), _plan([(20, [1]), (20, [1, 0])]))
        time.sleep(1.0)
        if layerwise:  # granted during the prefill: the decode instance posted its receives
            assert "doomed" in group.managers[0].grants
        victim.kill()
        doomed = outputs.collect({"doomed"})["doomed"]
    finally:
        os.kill(keeper.pid, signal.SIGCONT)
    assert isinstance(doomed, GroupFailure)
    assert "prefill instance 1 (rank 1) exited" in str(doomed)
    rest = outputs.collect({"steady"})
    assert len(rest["steady"]) == 40
    # Plans naming the dead instance are refused; the rest of the pool still serves.
    with pytest.raises(GroupFailure, match="prefill instance 1 is down"):
        group.submit("again", prompts[0], _greedy(4), _plan([(40, [1])]))
    group.submit("after", prompts[0], _greedy(4), _plan([(40, [0])]))
    assert outputs.collect({"after"})["after"] == expected[0]
    loads = {(i.role, i.index): i for i in group.instances()}
    assert loads[("prefill", 1)].queued_seconds >= 1e9


def test_layerwise_pieces_leave_layer_by_layer_while_their_prefill_computes(
    tiny_checkpoint: Callable[..., Path],
    tetris_factory: Callable[..., tuple[TetrisGroup, Outputs]],
) -> None:
    """§4.2 with layer-wise transmission: the handshake runs while the pool computes, and each
    layer leaves as soon as the last chunk has computed it. Instance 1 is stopped until both
    members' pieces are granted, so instance 0 waits in layer 0's ring with its grant in the
    pipe: every layer of every piece leaves before its prefill ends. Tokens are exact."""
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=4)
    prompts = _prompts([33], seed=21)
    expected = _reference(folder, prompts, 5)
    group, outputs = tetris_factory(
        folder,
        {
            "prefill_instances": 2,
            "decode_instances": 1,
            "transfer_backends": 2,  # one piece per member, both granted at once
            "layerwise_transfer": True,
        },
    )
    partner = group.procs[1]
    os.kill(partner.pid, signal.SIGSTOP)
    try:
        group.submit("s", prompts[0], _greedy(5), _plan([(33, [0, 1])]))
        deadline = time.monotonic() + 30
        while group.managers[0].grants.count("s") < 2:
            assert time.monotonic() < deadline, group.managers[0].grants
            time.sleep(0.02)
        time.sleep(0.2)  # the grants' "go" reach the members' pipes
    finally:
        os.kill(partner.pid, signal.SIGCONT)
    assert outputs.collect({"s"})["s"] == expected[0]
    stats = group.stats()
    assert stats["streamed_layers"] == 2 * 4, stats  # two members' pieces, four layers each
    assert stats["streamed_layers_early"] == stats["streamed_layers"], stats


@pytest.mark.slow
@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
def test_smollm2_long_prompt_over_growing_groups_gives_one_process_tokens(
    smollm2_path: Path,
    tetris_factory: Callable[..., tuple[TetrisGroup, Outputs]],
    layerwise: bool,
) -> None:
    """SmolLM2 (9 heads, 3 KV heads), a prompt of several hundred tokens in two chunks on
    growing groups (1 -> 2 instances), decode on a TP-1 instance: the one-process tokens, with
    the KV handed over whole or streamed layer by layer."""
    ids = _prompts([300], vocab=49152, seed=11)[0]
    small = {"kv_cache_bytes": 64 << 20, "max_model_len": 512}
    engine = start_engine(EngineConfig(model=str(smollm2_path), **{**ENGINE, **small}))
    try:
        expected = engine.generate([ids], _greedy(8))[0].token_ids
    finally:
        engine.shutdown()
    group, outputs = tetris_factory(
        smollm2_path,
        {"prefill_instances": 2, "decode_instances": 1, "layerwise_transfer": layerwise},
        max_model_len=512,
    )
    group.submit("long", ids, _greedy(8), _plan([(128, [1]), (172, [1, 0])]))
    assert outputs.collect({"long"})["long"] == expected


def test_profile_times_the_running_pool_between_live_requests(
    tiny_checkpoint: Callable[..., Path],
    tetris_factory: Callable[..., tuple[TetrisGroup, Outputs]],
) -> None:
    """Worker.ProfileTetris's group side: every (SP, C, L) point of the grid is timed on the
    live pool, a request submitted meanwhile still gets the one-process tokens, and a grid the
    pool cannot run is refused naming the field."""
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=2)
    prompts = _prompts([21])
    expected = _reference(folder, prompts, 4)
    group, outputs = tetris_factory(folder, {"prefill_instances": 2, "decode_instances": 1})
    group.submit("live", prompts[0], _greedy(4), _plan([(9, [1]), (12, [1, 0])]))
    samples = group.profile([], [0, 8], [4, 8, 12], 2)
    assert sorted({(sp, c, n) for sp, c, n, _ in samples}) == [
        (sp, c, n) for sp in (1, 2) for c in (0, 8) for n in (4, 8, 12)
    ]
    assert len(samples) == 24 and all(seconds > 0 for *_, seconds in samples)
    assert outputs.collect({"live"})["live"] == expected[0]
    for sizes, lengths, field in (([3], [4], "sp_sizes"), ([1], [0], "lengths")):
        with pytest.raises(InvalidRequestError) as info:
            group.profile(sizes, [0], lengths, 1)
        assert info.value.field == field
    with pytest.raises(InvalidRequestError, match="positions"):
        group.profile([1], [0], [group.max_model_len + 1], 1)
    with pytest.raises(InvalidRequestError, match="at most 4096") as info:
        group.profile([1, 2], [0, 8], [4, 8, 12], 1000)
    assert info.value.field == "repeats"
    # A caller that went away (a cancelled ProfileTetris) stops it between points.
    stop = threading.Event()
    stop.set()
    with pytest.raises(GroupFailure, match="stopped"):
        group.profile([1], [0, 8], [4, 8, 12], 1, stop)
    assert group.stats()["prefills"] == 1  # probes are not requests


def test_a_member_prefills_its_next_request_while_its_pieces_wait_for_a_slot(
    tiny_checkpoint: Callable[..., Path],
    tetris_factory: Callable[..., tuple[TetrisGroup, Outputs]],
) -> None:
    """§4.2's overlap: with one transfer slot and the decode instance stopped (nothing lands, so
    the slot stays taken), the member hands its first piece over, offers the rest and goes on
    to prefill the next request instead of waiting; once the decode instance runs again both
    requests finish with the one-process tokens."""
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=2)
    prompts = _prompts([30, 17], seed=11)
    expected = _reference(folder, prompts, 4)
    group, outputs = tetris_factory(
        folder,
        {
            "prefill_instances": 2,
            "decode_instances": 1,
            "transfer_backends": 1,
            "transfer_buffer_bytes": 4 * 2 * 2 * 2 * 8 * 4,  # 4 rows a piece: 8 pieces
        },
    )
    decode = group.procs[2]
    os.kill(decode.pid, signal.SIGSTOP)
    try:
        group.submit("a", prompts[0], _greedy(4), _plan([(30, [0])]))
        group.submit("b", prompts[1], _greedy(4), _plan([(17, [0])]))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            stats = group.stats()
            if stats["prefills"] == 2 and stats["handshake_queue"] >= 1:
                break
            time.sleep(0.05)
        assert stats["prefills"] == 2, stats  # b ran while a's pieces waited
        assert stats["transfer_slots_free"] == 0 and stats["handshake_queue"] >= 1, stats
    finally:
        os.kill(decode.pid, signal.SIGCONT)
    got = outputs.collect({"a", "b"})
    assert [got["a"], got["b"]] == expected


def test_more_requests_than_slots_are_granted_in_first_handshake_order(
    tiny_checkpoint: Callable[..., Path],
    tetris_factory: Callable[..., tuple[TetrisGroup, Outputs]],
) -> None:
    """§4.2 under a shortage: one transfer slot, five requests. The first (z) takes the slot and
    cannot land while the decode instance is stopped; the other four prefill on their own
    members and all wait for the slot at once. Released, the slot goes to them in the order of
    their first handshakes (the order they were submitted), not in the order their members
    happen to ask, and every request ends with the one-process tokens."""
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=2)
    names = ["z", "a", "b", "c", "d"]
    members = [0, 1, 2, 3, 0]  # d shares z's member: it asks once z's piece is granted
    prompts = _prompts([19, 26, 11, 23, 15], seed=17)
    expected = _reference(folder, prompts, 4)
    group, outputs = tetris_factory(
        folder, {"prefill_instances": 4, "decode_instances": 1, "transfer_backends": 1}
    )
    decode = group.procs[4]

    def wait_for(what: Callable[[dict[str, float]], bool]) -> dict[str, float]:
        deadline = time.monotonic() + 60
        stats = group.stats()
        while not what(stats):
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)
            stats = group.stats()
        return stats

    os.kill(decode.pid, signal.SIGSTOP)
    try:
        group.submit("z", prompts[0], _greedy(4), _plan([(19, [0])]))
        wait_for(lambda s: s["transfer_slots_free"] == 0)  # z holds the one slot
        # Announced (the first handshake) in this order; a member whose shorter prefill ends
        # first and asks first (b before a) must not jump the queue.
        for name, ids, m in zip(names[1:], prompts[1:], members[1:], strict=True):
            group.submit(name, ids, _greedy(4), _plan([(len(ids), [m])]))
        wait_for(lambda s: s["prefills"] == 5 and s["handshake_queue"] == 4)
        assert group.managers[0].grants == ["z"], group.managers[0].grants
    finally:
        os.kill(decode.pid, signal.SIGCONT)
    got = outputs.collect(set(names))
    assert [got[n] for n in names] == expected
    assert group.managers[0].grants == names


@pytest.mark.parametrize(
    ("decode_tp", "layerwise"), [(1, False), (2, False), (2, True)], ids=["1", "2", "2-layerwise"]
)
def test_prefill_instances_of_tp2_hand_over_to_any_decode_tp_with_one_process_tokens(
    decode_tp: int,
    layerwise: bool,
    tiny_checkpoint: Callable[..., Path],
    tetris_factory: Callable[..., tuple[TetrisGroup, Outputs]],
) -> None:
    """Prefill instances of TP 2 (§3.2: each instance a TP group; a chunk's ring runs per head
    shard between the same TP rank of each instance): growing groups and one-chunk plans, KV
    handed from both TP ranks of each member, re-laid into decode TP 1 (the two head shards
    joined) or TP 2 (one shard each)."""
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=2)
    prompts = _prompts([29, 18, 23], seed=13)
    expected = _reference(folder, prompts, 5)
    group, outputs = tetris_factory(
        folder,
        {
            "prefill_instances": 2,
            "prefill_tp": 2,
            "decode_instances": 1,
            "decode_tp": decode_tp,
            "transfer_buffer_bytes": 6 * 2 * 2 * 1 * 8 * 4,  # a few pieces per member
            "layerwise_transfer": layerwise,
        },
    )
    assert len(group.pool_conns) == 2 and all(len(c) == 2 for c in group.pool_conns)
    plans = [
        _plan([(12, [1]), (17, [1, 0])]),  # 1 -> 2 instances
        _plan([(18, [0])]),
        _plan([(23, [0, 1])]),
    ]
    for i, (ids, plan) in enumerate(zip(prompts, plans, strict=True)):
        group.submit(f"r{i}", ids, _greedy(5), plan)
    got = outputs.collect({f"r{i}" for i in range(3)})
    assert [got[f"r{i}"] for i in range(3)] == expected
    samples = group.profile([1, 2], [0, 8], [4, 8, 12], 1)  # the probes run on TP 2 too
    assert len(samples) == 12 and all(s > 0 for *_, s in samples)


def test_head_routes_send_each_head_once_whatever_the_two_tps() -> None:
    from gearshift.worker.policies.tetris.handoff import head_route, kv_heads_of

    for kv_heads in (1, 2, 4):
        for prefill_tp in (1, 2, 4, 8):
            for decode_tp in (1, 2, 4, 8):
                try:
                    kv_heads_of(0, prefill_tp, kv_heads)
                    kv_heads_of(0, decode_tp, kv_heads)
                except ValueError:
                    continue
                for t in range(decode_tp):
                    routes = [
                        head_route(j, prefill_tp, t, decode_tp, kv_heads) for j in range(prefill_tp)
                    ]
                    got = [h for r in routes if r is not None for h in range(r.start, r.stop)]
                    want = kv_heads_of(t, decode_tp, kv_heads)
                    # Every head this decode rank keeps arrives exactly once, in head order.
                    assert got == list(range(want.start, want.stop)), (kv_heads, prefill_tp, t)


@pytest.mark.slow
def test_a_whole_piece_leaves_during_the_members_next_prefill(
    smollm2_path: Path,
    tetris_factory: Callable[..., tuple[TetrisGroup, Outputs]],
) -> None:
    """§4.2, whole hand-off: a member offers its piece when its prefill ends and goes on with
    its next prefill; the grant that comes meanwhile starts the send between that prefill's
    layers, not after it. A short request then a long one on the same instance: the short one's
    piece leaves while the long one (300 tokens through SmolLM2's 30 layers) computes, and
    both give the one-process tokens."""
    short, long = _prompts([16, 300], vocab=49152, seed=13)
    small = {"kv_cache_bytes": 64 << 20, "max_model_len": 512}
    engine = start_engine(EngineConfig(model=str(smollm2_path), **{**ENGINE, **small}))
    try:
        expected = [o.token_ids for o in engine.generate([short, long], _greedy(4))]
    finally:
        engine.shutdown()
    group, outputs = tetris_factory(
        smollm2_path, {"prefill_instances": 2, "decode_instances": 1}, max_model_len=512
    )
    group.submit("short", short, _greedy(4), _plan([(16, [0])]))
    group.submit("long", long, _greedy(4), _plan([(300, [0])]))
    got = outputs.collect({"short", "long"})
    assert [got["short"], got["long"]] == expected
    assert group.stats()["pieces_sent_mid_prefill"] == 1.0, group.stats()


def test_more_requests_than_the_decode_instances_seats_all_end_with_one_process_tokens(
    tiny_checkpoint: Callable[..., Path],
    tetris_factory: Callable[..., tuple[TetrisGroup, Outputs]],
) -> None:
    """A decode instance holds a request's KV from its Expect on, not only while it decodes:
    with max_num_seqs 2, seven requests at once are seven holders of block-table rows, where
    the engine has seats for two a step. They must all be served (the rest wait their turn,
    as in vLLM), with the one-process tokens; the decode rank must not fail for want of a
    row (it raised IndexError here, 2026-11-28)."""
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=2)
    names = [f"r{i}" for i in range(7)]
    prompts = _prompts([9, 14, 11, 6, 17, 12, 8], seed=23)
    expected = _reference(folder, prompts, 5)
    group, outputs = tetris_factory(
        folder, {"prefill_instances": 2, "decode_instances": 1}, max_num_seqs=2
    )
    for i, (name, ids) in enumerate(zip(names, prompts, strict=True)):
        group.submit(name, ids, _greedy(5), _plan([(len(ids), [i % 2])]))
    got = outputs.collect(set(names))
    assert [got[n] for n in names] == expected


def test_a_decode_instance_out_of_kv_recomputes_what_it_preempts(
    tiny_checkpoint: Callable[..., Path],
    tetris_factory: Callable[..., tuple[TetrisGroup, Outputs]],
) -> None:
    """Requests placed on a decode instance hold their prompts' blocks; their outputs grow into
    the rest. When it runs out, the scheduler preempts a sequence (recompute), and the decode
    instance, which otherwise only decodes, must prefill it again itself: the pool has long
    handed it over, in as many steps as its token budget takes. Four requests of up to 50
    tokens on a 24-block (96-token) cache, 16 tokens a step: every one ends with the
    one-process tokens (a preempted one waited forever before, or stopped part way through its
    recompute, 2026-11-28)."""
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=2)
    names = ["a", "b", "c", "d"]
    prompts = _prompts([9, 10, 8, 10], seed=29)
    expected = _reference(folder, prompts, 40)
    group, outputs = tetris_factory(
        folder,
        {"prefill_instances": 2, "decode_instances": 1},
        kv_cache_bytes=24 << 10,  # 256 bytes a token: 24 blocks of 4 tokens
        max_model_len=64,
        max_num_batched_tokens=16,  # a recompute of up to 50 tokens takes several steps
    )
    for i, (name, ids) in enumerate(zip(names, prompts, strict=True)):
        group.submit(name, ids, _greedy(40), _plan([(len(ids), [i % 2])]))
    got = outputs.collect(set(names), timeout_s=60)
    assert [got[n] for n in names] == expected
    # The decode instance did preempt (its periodic snapshot says so): the case was exercised.
    deadline = time.monotonic() + 30
    while (snap := group.snapshots[0]) is None or snap.stats.num_preemptions == 0:
        assert time.monotonic() < deadline, snap
        time.sleep(0.05)
