"""Model test fixtures: the kernel fixtures, for the fused decode-layer tests."""

from __future__ import annotations

from tests.worker.kernels.conftest import cpu_kernels, kernels_off

__all__ = ["cpu_kernels", "kernels_off"]
