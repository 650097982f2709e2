"""Kernel test fixtures: the extension is built (or loaded from its cache) once per session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from gearshift.worker import kernels
from gearshift.worker.kernels import ops


@pytest.fixture(scope="session")
def cpu_kernels() -> None:
    """Skips kernel tests where the kernels are off (GEARSHIFT_CPU_KERNELS=0) or cannot build."""
    if not kernels.available():
        pytest.skip("CPU kernels unavailable (disabled or no compiler); torch paths tested")


@pytest.fixture
def kernels_off(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Call to route every layer of this process through its torch reference for the test."""

    def off() -> None:
        monkeypatch.setattr(ops, "available", lambda: False)
        monkeypatch.setattr(kernels, "available", lambda: False)

    return off


@pytest.fixture(scope="session")
def generic_kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A kernel cache for the portable ``generic`` build: the two-process build test fills it and
    the portability test then runs the kernel tests on that same library (one compile, not two;
    either test builds it itself when it runs alone)."""
    return tmp_path_factory.mktemp("kernels-generic")
