"""Kernel test fixtures: the extension is built (or loaded from its cache) once per session."""

from __future__ import annotations

from collections.abc import Callable

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
