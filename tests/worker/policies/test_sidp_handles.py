"""SiDP's segment addresses (worker/policies/sidp/handles.py) as typed messages: they round-trip
exactly, a pickle is refused unloaded, and every field a reader would act on is checked, the
refusal naming the rank and the field. The GPU half (a real CUDA IPC handle from ``address()``
mapped by another process) is in test_sidp_gpu.py."""

from __future__ import annotations

import json
import pickle
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from gearshift.worker.errors import GroupFailure
from gearshift.worker.policies.sidp.handles import (
    SEGMENTS,
    CudaIpcTensor,
    Expect,
    RankSegments,
    SegmentAddress,
    check_rank,
)
from gearshift.worker.policies.sidp.shared_weights import DeviceSegment, new_segment_name
from gearshift.worker.wire import WireError
from tests.worker.policies.tetris.test_tetris_messages import live_pickle

KEY = "local"
NUMEL = 3 * 64 * 128
# dp 2, tp 2, 4 layers: replica 0 owns layers 0 and 2, replica 1 layers 1 and 3.
OWNED = {0: [0, 2], 1: [1, 3]}
IPC = CudaIpcTensor(
    device=1,
    storage_handle=b"c" + bytes(range(64)),  # torch's type prefix, then cudaIpcMemHandle_t
    storage_size_bytes=2 * 1024 * 1024,
    storage_offset_bytes=4096,
    tensor_offset=0,
    numel=NUMEL,
    dtype="float32",
    ref_counter_handle=b"/torch_4242_1804289383_0",
    ref_counter_offset=3,
    event_handle=bytes(64),
    event_sync_required=True,
)


def _expect(on_gpu: bool, dtype: torch.dtype = torch.float32) -> Expect:
    return Expect(KEY, OWNED, 2, NUMEL, dtype, on_gpu)


def _rank3(on_gpu: bool) -> RankSegments:
    """What rank 3 (replica 1, TP rank 1) says: layers 1 and 3 of TP rank 1."""
    cuda = IPC if on_gpu else None
    return RankSegments(
        3,
        1 if on_gpu else None,
        [SegmentAddress(layer, 1, new_segment_name(KEY, layer, 1), cuda) for layer in (1, 3)],
    )


@pytest.mark.parametrize("on_gpu", [False, True])
def test_an_address_round_trips_exactly_and_passes_its_checks(on_gpu: bool) -> None:
    msg = _rank3(on_gpu)
    data = SEGMENTS.encode(msg)
    assert json.loads(data)[0] == "RankSegments"  # JSON, not a pickle
    back = SEGMENTS.decode(data)
    assert back == msg and type(back.segments[0]) is SegmentAddress
    if on_gpu:
        assert back.segments[0].cuda == IPC and type(back.segments[0].cuda.storage_handle) is bytes
    check_rank(3, back, _expect(on_gpu))


def test_a_pickle_is_refused_and_never_loaded(tmp_path: Path) -> None:
    payload, target = live_pickle(tmp_path)
    with pytest.raises(WireError, match="not a message"):
        SEGMENTS.decode(payload)
    # What the exchange used to carry: reduce_tensor's (rebuild function, args), pickled.
    with pytest.raises(WireError, match="not a message"):
        SEGMENTS.decode(pickle.dumps(({(1, 1): ("name", (print, ("hi",)))}, {3: 1})))
    assert not target.exists()


def _json_edit(path: tuple[int, ...], value: Any) -> bytes:
    tree = json.loads(SEGMENTS.encode(_rank3(True)))
    node = tree
    for i in path[:-1]:
        node = node[i]
    node[path[-1]] = value
    return json.dumps(tree).encode()


@pytest.mark.parametrize(
    ("path", "value", "words"),
    [
        ((1,), "3", "RankSegments.rank: expected int"),
        ((3, 0, 4), ["CudaIpcTensor", 1], "SegmentAddress.cuda: expected a CudaIpcTensor"),
        ((3, 0, 4, 2), "!!not base64", "CudaIpcTensor.storage_handle: expected base64 bytes"),
        ((3, 0, 4, 7), 32, "CudaIpcTensor.dtype: expected str"),
        ((3, 0, 4, 11), "yes", "CudaIpcTensor.event_sync_required: expected bool"),
        ((3, 0, 3), ["gearshift-sidp-x"], "SegmentAddress.name: expected str"),
        ((3, 0), ["Evil", 1], "expected a SegmentAddress"),
    ],
)
def test_malformed_json_is_refused_naming_the_field(
    path: tuple[int, ...], value: Any, words: str
) -> None:
    with pytest.raises(WireError, match=re.escape(words)):
        SEGMENTS.decode(_json_edit(path, value))


def _seg(msg: RankSegments, **change: Any) -> RankSegments:
    return replace(msg, segments=[replace(msg.segments[0], **change), *msg.segments[1:]])


def _ipc(**change: Any) -> RankSegments:
    return _seg(_rank3(True), cuda=replace(IPC, **change))


# Refused in a GPU group: (message, field, words of the reason).
BAD_GPU: list[tuple[RankSegments, str, str]] = [
    (replace(_rank3(True), rank=1), "rank", "it says it is rank 1"),
    (replace(_rank3(True), device=None), "device", "missing on a GPU group"),
    (replace(_rank3(True), device=-1), "device", "-1 is not in [0, 1024)"),
    (replace(_rank3(True), segments=_rank3(True).segments[:1]), "segments", "layers [1]"),
    (
        replace(_rank3(True), segments=[_rank3(True).segments[0]] * 2),
        "segments",
        "layers [1, 1], expected [1, 3]",
    ),
    (_seg(_rank3(True), layer=0), "segments", "layers [0, 3]"),
    (_seg(_rank3(True), tp_rank=0), "segments[0].tp_rank", "0, expected 1"),
    (_seg(_rank3(True), cuda=None), "segments[0].cuda", "missing"),
    (_ipc(dtype="float64"), "segments[0].cuda.dtype", "'float64', expected torch.float32"),
    (_ipc(dtype="torch.float32"), "segments[0].cuda.dtype", "'torch.float32'"),
    (_ipc(dtype="__class__"), "segments[0].cuda.dtype", "'__class__'"),
    (_ipc(numel=NUMEL + 1), "segments[0].cuda.numel", f"{NUMEL + 1}, expected {NUMEL}"),
    (_ipc(device=2), "segments[0].cuda.device", "2, not 1"),
    (_ipc(device=-3), "segments[0].cuda.device", "-3 is not in"),
    (_ipc(storage_handle=b""), "segments[0].cuda.storage_handle", "0 bytes"),
    (_ipc(storage_handle=bytes(5000)), "segments[0].cuda.storage_handle", "5000 bytes"),
    (_ipc(event_handle=b""), "segments[0].cuda.event_handle", "0 bytes"),
    (_ipc(ref_counter_handle=b"/../../x"), "segments[0].cuda.ref_counter_handle", "not a"),
    (_ipc(ref_counter_handle=b"torch_1"), "segments[0].cuda.ref_counter_handle", "not a"),
    (_ipc(ref_counter_offset=-1), "segments[0].cuda.ref_counter_offset", "-1 is not in"),
    (_ipc(storage_size_bytes=0), "segments[0].cuda.storage_size_bytes", "0 is not in"),
    (_ipc(storage_offset_bytes=-4096), "segments[0].cuda.storage_offset_bytes", "not in"),
    # The shard must lie inside the storage: 2 MiB of float32 hold 524288 elements.
    (_ipc(tensor_offset=524288 - NUMEL + 1), "segments[0].cuda.tensor_offset", "not in"),
    (_ipc(tensor_offset=-1), "segments[0].cuda.tensor_offset", "-1 is not in"),
    (_ipc(storage_size_bytes=NUMEL * 4 - 4), "segments[0].cuda.tensor_offset", "not in [0, 0)"),
]
BAD_CPU: list[tuple[RankSegments, str, str]] = [
    (replace(_rank3(False), device=0), "device", "set on a CPU group"),
    (_seg(_rank3(False), name="../../etc/passwd"), "segments[0].name", "not this group's"),
    (
        _seg(_rank3(False), name=new_segment_name("other", 1, 1)),
        "segments[0].name",
        "not this group's segment",
    ),
    (_seg(_rank3(False), name=new_segment_name(KEY, 3, 1)), "segments[0].name", "not this"),
    (_seg(_rank3(False), cuda=IPC), "segments[0].cuda", "set on a CPU group"),
]
BAD = [(m, True, f, w) for m, f, w in BAD_GPU] + [(m, False, f, w) for m, f, w in BAD_CPU]


@pytest.mark.parametrize(
    ("msg", "on_gpu", "field", "words"), BAD, ids=[f"{f}:{w[:20]}" for _, _, f, w in BAD]
)
def test_every_field_a_reader_acts_on_is_checked(
    msg: RankSegments, on_gpu: bool, field: str, words: str
) -> None:
    back = SEGMENTS.decode(SEGMENTS.encode(msg))  # it crosses the wire as it is
    with pytest.raises(GroupFailure, match=re.escape(f"rank 3's {field} refused: ")) as err:
        check_rank(3, back, _expect(on_gpu))
    assert words in str(err.value)


def test_the_dtype_must_be_the_models() -> None:
    with pytest.raises(GroupFailure, match=r"cuda\.dtype refused: 'float32', expected torch\.bf"):
        check_rank(3, _rank3(True), _expect(True, torch.bfloat16))
    tail = _ipc(tensor_offset=524288 - NUMEL)  # the last place the shard fits
    check_rank(3, tail, _expect(True))


def test_a_handle_for_a_device_this_host_lacks_is_refused_before_torch_maps_it() -> None:
    count = torch.cuda.device_count()  # 0 here: any handle names a missing device
    with pytest.raises(GroupFailure, match=f"device {count} is not a device of this host"):
        DeviceSegment.attach("gearshift-sidp-x", replace(IPC, device=count))
