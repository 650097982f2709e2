"""Attention test fixtures: Triton's interpreter for the triton backend's kernels on CPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def interpreter(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Run the triton backend's kernels in Triton's interpreter, on CPU tensors.

    tests/conftest.py imports triton for its interpreter on machines without CUDA. Where CUDA is
    present triton compiles for the GPU instead (test_triton_gpu.py runs the kernels there), so
    these tests skip; without CUDA a triton not set up for the interpreter fails them.
    """
    import torch

    from gearshift.worker.attention.triton import jit

    if torch.cuda.is_available() and not jit.library_interpreted():
        pytest.skip("triton compiles for this machine's GPU; the gpu-marked tests run the kernels")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield
