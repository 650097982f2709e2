"""A ring step through the attention core (block_attention.py): the Triton backend's kernels, as
a GPU rank runs them (here under Triton's interpreter, CPU tensors), give the torch reference's
output and log-sum-exp for every (member, block origin) pair of a zig-zag layout with history,
GQA, fp32. Tolerances as tests/worker/attention/test_triton_kernels.py's."""

from __future__ import annotations

import pytest
import torch

from gearshift.worker.attention.torch_ref import TorchAttention
from gearshift.worker.policies.tetris.block_attention import attend_block, paged_block
from gearshift.worker.policies.tetris.zigzag import ZigZag

pytest.importorskip("triton")

ATOL, RTOL = 1e-5, 1e-4


@pytest.fixture
def interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    from gearshift.worker.attention.triton import jit

    if torch.cuda.is_available() and not jit.library_interpreted():
        pytest.skip("triton compiles for this machine's GPU")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize(("length", "history"), [(23, (5, 4, 4)), (7, (0, 0, 0))])
def test_every_ring_step_on_the_triton_core_equals_the_torch_core(interpreter, length, history):
    from gearshift.worker.attention.triton_backend import TritonAttention

    hq, hkv, dim = 4, 2, 16
    scale = dim**-0.5
    layout = ZigZag(length, len(history))
    g = torch.Generator().manual_seed(7)
    blocks = []
    for member, rows in enumerate(history):
        n = layout.local_length(member)
        hist = (torch.randn(rows, hkv, dim, generator=g), torch.randn(rows, hkv, dim, generator=g))
        k, v = torch.randn(n, hkv, dim, generator=g), torch.randn(n, hkv, dim, generator=g)
        blocks.append(paged_block(hist, k, v))
    seen = 0
    for me in range(len(history)):
        q = torch.randn(layout.local_length(me), hq, dim, generator=g)
        for origin, block in enumerate(blocks):
            args = (q, block, origin, me, layout, history[origin])
            want = attend_block(TorchAttention(scale), *args)
            got = attend_block(TritonAttention(scale), *args)
            assert (want is None) == (got is None), (me, origin)
            if want is None or got is None:
                continue
            seen += 1
            torch.testing.assert_close(got[0], want[0], atol=ATOL, rtol=RTOL)
            finite = want[1].isfinite()
            assert torch.equal(finite, got[1].isfinite()), (me, origin)
            torch.testing.assert_close(got[1][finite], want[1][finite], atol=ATOL, rtol=RTOL)
    assert seen >= len(history)  # each member's own block at least
