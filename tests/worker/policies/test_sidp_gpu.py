"""SiDP on a GPU (marked gpu: skipped without one).

Weight-as-a-Service on GPUs (SiDP §4.2): an owner keeps its FFN shards in device memory, the
other replicas map them over CUDA IPC, and each rank's housekeeper copies them into device slots
on its own stream; compute's stream waits on the copy's event, and a copy into a slot waits on
the event compute recorded when it handed the slot back.

A host with one GPU runs the replicas on that one device (``device="cuda:0"``: ranks pinned to
one GPU, over gloo, since NCCL refuses two ranks on one device); the IPC mapping, the side stream
and the events are the same as between GPUs. The reference is the single-process engine on the
same GPU, same weights, fp32.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from gearshift.worker.config import EngineConfig
from gearshift.worker.errors import GroupFailure
from gearshift.worker.launch import start_engine
from gearshift.worker.policies.sidp.ffn import run_ffn
from gearshift.worker.policies.sidp.handles import (
    SEGMENTS,
    Expect,
    RankSegments,
    SegmentAddress,
    check_rank,
)
from gearshift.worker.policies.sidp.housekeeper import Housekeeper
from gearshift.worker.policies.sidp.shared_weights import (
    DeviceSegment,
    FfnLayout,
    new_segment_name,
    segments,
)
from tests.worker.policies.test_sidp_replicas import (  # noqa: F401 - the fixture
    ENGINE,
    _assert_all_equal,
    _flip_modes,
    _greedy,
    _prompts,
    _work,
    replica_factory,
)

pytestmark = pytest.mark.gpu

GPU: dict[str, Any] = {"device": "cuda:0", "attention_backend": "torch"}


def _reference(folder: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    engine = start_engine(EngineConfig(model=str(folder), **{**ENGINE, **GPU}))
    try:
        return [o.token_ids for o in engine.generate(prompts, _greedy(max_tokens))]
    finally:
        engine.shutdown()


def test_slots_are_refilled_only_after_the_ffn_that_read_them_ran():
    """One slot, two remote layers, FFNs long enough that a copy not ordered after the previous
    layer's FFN would overwrite its weights mid-matmul: every output equals the FFN of the
    source weights, and the copies ran on the housekeeper's stream, not compute's."""
    device = torch.device("cuda", 0)
    layout = FfnLayout(hidden=1024, inter=4096, bias=True)
    g = torch.Generator(device=device).manual_seed(0)
    sources = {
        layer: torch.randn(layout.numel, device=device, generator=g) * 0.02 for layer in (1, 3)
    }
    hk = Housekeeper(
        layout=layout,
        num_layers=4,
        order=[1, 3],
        cycle_start={0: 0, 1: 0, 2: 2, 3: 2},
        sources=sources,
        slots=1,
        prefetch_depth=3,
        peak_shifting=False,
        device=device,
    ).start()
    x = torch.randn(8192, layout.hidden, device=device, generator=g)
    want = {layer: run_ffn(x, layout.views(src)) for layer, src in sources.items()}
    try:
        assert hk.stream is not None and hk.stream != torch.cuda.current_stream(device)
        got = []
        for _ in range(6):
            for layer in range(4):
                hk.begin_layer(layer)
                if layer in sources:
                    out = run_ffn(x, hk.acquire(layer))
                    hk.release(layer)
                    got.append((layer, out))
        torch.cuda.synchronize(device)
        for layer, out in got:
            torch.testing.assert_close(out, want[layer])
        assert hk.stats.fetches >= 12
        assert all(s.flat.device == device for s in hk._slots)
    finally:
        hk.close()


PROBE = Expect("local", {0: [0]}, 1, 4096, torch.float32, True)


def _read_shared(data: bytes, out: Any) -> None:
    """What a reader does with a peer's bytes: decode, check every field, map with torch's
    rebuild function (never one from the wire)."""
    msg = SEGMENTS.decode(data)
    check_rank(0, msg, PROBE)
    address = msg.segments[0]
    assert address.cuda is not None
    seg = DeviceSegment.attach(address.name, address.cuda)
    t = seg.tensor(torch.float32)
    out.put((str(t.device), float(t.sum().item()), t.numel()))
    seg.close()


def test_a_device_segment_is_read_by_another_process_over_cuda_ipc() -> None:
    """The typed address of a real allocation: it passes the reader's checks, crosses as JSON
    bytes and maps the owner's memory in another process; tampered, it is refused."""
    name = new_segment_name("local", 0, 0)
    seg = DeviceSegment.create(name, 4096, torch.float32, torch.device("cuda", 0))
    seg.tensor(torch.float32).copy_(torch.arange(4096, dtype=torch.float32))
    torch.cuda.synchronize()
    msg = RankSegments(0, 0, [SegmentAddress(0, 0, name, seg.address())])
    data = SEGMENTS.encode(msg)
    assert SEGMENTS.decode(data) == msg
    cuda = msg.segments[0].cuda
    assert cuda is not None and cuda.dtype == "float32" and cuda.numel == 4096
    for bad in (replace(cuda, dtype="float16"), replace(cuda, numel=8192)):
        with pytest.raises(GroupFailure, match="sidp handle exchange: rank 0's segments"):
            check_rank(0, replace(msg, segments=[replace(msg.segments[0], cuda=bad)]), PROBE)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_read_shared, args=(data, out))
    proc.start()
    try:
        device, total, numel = out.get(timeout=120)
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
        seg.close()
    assert (device, numel) == ("cuda:0", 4096)
    assert total == float(sum(range(4096)))


@pytest.mark.parametrize(("dp", "layers", "mode"), [(2, 4, "WAS"), (3, 5, "WAS"), (2, 4, "CAS")])
def test_replicas_on_the_gpu_match_the_single_process_reference(
    tiny_checkpoint,
    replica_factory,  # noqa: F811
    dp: int,
    layers: int,
    mode: str,
):
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=layers)
    prompts = _prompts(4)
    want = dict(zip(map(tuple, prompts), _reference(folder, prompts, 8), strict=True))
    group = replica_factory(folder, {"dp": dp, "mode": mode}, **GPU)
    # The owned shards are device memory shared over CUDA IPC: no host segment exists.
    assert segments(pids=[os.getpid(), *(p.pid for p in group.procs)]) == []
    work = _work(dp, prompts, 8)
    _assert_all_equal(group.generate(work), work, want)
    stats = [group.stats(r)["policy"] for r in range(dp)]
    if mode == "WAS":
        assert all(s["sidp_fetched_weight_bytes"] > 0 for s in stats)
    else:
        assert all(s["sidp_cas_fused_rows"] > 0 for s in stats)


def test_mode_switches_on_the_gpu_keep_greedy_text(
    tiny_checkpoint,
    replica_factory,  # noqa: F811
):
    """WaS -> CaS -> WaS ... mid-generation: each return to WaS restarts the housekeeper's
    window on its stream (slots dropped, events reused)."""
    folder = tiny_checkpoint("llama2-bias", num_heads=8, num_kv_heads=2, layers=4)
    prompts = _prompts(4)
    want = dict(zip(map(tuple, prompts), _reference(folder, prompts, 32), strict=True))
    group = replica_factory(folder, {"dp": 2, "mode": "WAS"}, **GPU)
    done: list[int] = []
    flipper = threading.Thread(target=_flip_modes, args=(group.store.port, 2, 4, done))
    flipper.start()
    try:
        work = _work(2, prompts, 32)
        results = group.generate(work)
    finally:
        flipper.join(70)
    _assert_all_equal(results, work, want)
    assert len(done) == 4
    assert [group.stats(r)["sync"]["switches"] for r in range(2)] == [4, 4]
