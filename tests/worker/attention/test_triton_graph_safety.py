"""The triton backend's decode-only steps are capturable in a CUDA graph: the host reads no device
value, and every launch (grid, constants, scalar arguments) is the same for any sequence lengths
and block tables of the same shapes, so a graph captured once replays for all of them.

Kernel launches are recorded instead of run (what is checked is the host's side); on a GPU,
test_triton_gpu.py captures and replays a real graph.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch

from gearshift.worker.attention.triton_backend import TritonAttention
from tests.worker.attention.triton_batches import Batch, make_batch

pytest.importorskip("triton")


class _Launches:
    """Stands in for ``jit.kernel``: records (kernel, grid, scalar args, constants) per launch."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def __call__(self, fn: Any) -> Any:
        calls = self.calls

        class _Grid:
            def __getitem__(self, grid: tuple[int, ...]) -> Any:
                def launch(*args: Any, **kwargs: Any) -> None:
                    scalars = tuple(a for a in args if not isinstance(a, torch.Tensor))
                    calls.append((fn.__name__, tuple(grid), scalars, tuple(sorted(kwargs.items()))))

                return launch

        return _Grid()


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Launches]:
    from gearshift.worker.attention.triton import decode, kv_write, prefill

    recorder = _Launches()
    for module in (decode, kv_write, prefill):
        monkeypatch.setattr(module, "kernel", recorder)
    yield recorder


def _no_host_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every way of reading a tensor's value on the host raises from here on."""

    def refuse(name: str) -> Any:
        def read(*args: Any, **kwargs: Any) -> Any:
            raise AssertionError(f"host read of a device value: Tensor.{name}")

        return read

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, refuse(name))
    plain_getitem = torch.Tensor.__getitem__

    def getitem(self: torch.Tensor, index: Any) -> Any:
        parts = index if isinstance(index, tuple) else (index,)
        for part in parts:
            if isinstance(part, torch.Tensor) and part.dtype == torch.bool:
                raise AssertionError("boolean-mask indexing (a data-dependent shape)")
        return plain_getitem(self, index)

    monkeypatch.setattr(torch.Tensor, "__getitem__", getitem)


def _decode_bucket(seed: int, lens: list[int]) -> Batch:
    # A bucket of 4 decode rows and 2 padding tokens over a block table 40 blocks wide.
    return make_batch(
        lens, [], kv_heads=2, group=4, head_dim=64, block_size=16, padding=2, seed=seed,
        spare_width=40 - max(-(-n // 16) for n in lens),
    )  # fmt: skip


def test_decode_only_steps_read_nothing_on_the_host_and_launch_the_same(launches, monkeypatch):
    first = _decode_bucket(0, [5, 300, 17, 64])
    # Other lengths, other blocks, another max_decode_seq_len; the same shapes.
    second = _decode_bucket(1, [600, 2, 33, 129])
    # A padding row of length 0 (slot -1), as a bucket may pad instead.
    lens = second.meta.seq_lens.clone()
    lens[3] = 0
    third = replace(second.meta, seq_lens=lens, max_decode_seq_len=600)
    assert first.meta.block_tables.shape == second.meta.block_tables.shape
    core = TritonAttention(64**-0.5)
    _no_host_reads(monkeypatch)
    recorded = []
    for batch, meta in ((first, first.meta), (second, second.meta), (second, third)):
        launches.calls.clear()
        core.forward_lse(batch.q, batch.k, batch.v, batch.kv(), meta)
        core.forward(batch.q, batch.k, batch.v, batch.kv(), meta)
        recorded.append(list(launches.calls))
    # The KV write, the split ranges and their merge, twice (forward_lse, forward).
    names = [call[0] for call in recorded[0]]
    assert names == ["_write_kv", "_decode_split", "_merge_splits"] * 2
    assert recorded[1] == recorded[0] and recorded[2] == recorded[0]


def test_a_mixed_step_launches_the_prefill_kernel_once_for_every_chunk(launches):
    batch = make_batch(
        [40], [(20, 33), (9, 9)], kv_heads=2, group=2, head_dim=32, block_size=16, padding=1
    )
    TritonAttention(32**-0.5).forward_lse(batch.q, batch.k, batch.v, batch.kv(), batch.meta)
    names = [call[0] for call in launches.calls]
    assert names.count("_prefill") == 1 and names[0] == "_write_kv"
    grid = next(call[1] for call in launches.calls if call[0] == "_prefill")
    assert grid == (2, 1, 4)  # chunks, query tiles of the longest chunk, query heads
