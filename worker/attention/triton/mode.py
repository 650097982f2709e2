"""Whether the triton backend can run on a device here, decided without importing triton.

On CUDA it runs Triton's compiled kernels; on a CPU only Triton's interpreter
(``TRITON_INTERPRET=1``) runs them, on CPU tensors: slow, for tests and CI.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping

INTERPRET_ENV = "TRITON_INTERPRET"


def interpreting(env: Mapping[str, str] | None = None) -> bool:
    """Whether triton runs kernels in its interpreter (the values triton itself accepts)."""
    value = (os.environ if env is None else env).get(INTERPRET_ENV, "0")
    return value.strip().lower() in ("1", "true", "on", "yes")


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def refusal(device: str, env: Mapping[str, str] | None = None) -> str | None:
    """Why attention_backend=triton cannot run on ``device`` in this environment; None if it can."""
    kind = device.split(":", 1)[0]
    if not triton_installed():
        return "attention_backend=triton (--attention-backend triton) needs the triton package"
    if kind == "cuda":
        return None
    if kind == "cpu":
        if interpreting(env):
            return None
        return (
            f"attention_backend=triton (--attention-backend triton) on device={device} runs only "
            f"under Triton's interpreter ({INTERPRET_ENV}=1); on a CPU choose auto, cpu or torch"
        )
    return (
        f"attention_backend=triton (--attention-backend triton) needs a CUDA device, not "
        f"device={device}"
    )
