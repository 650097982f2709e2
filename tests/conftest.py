"""Shared pytest configuration: GPU tests skip cleanly without CUDA, what counts as slow, and
the point-to-point rules every test runs under.

`make test-fast` runs `-m "not slow"`: the unit tests, a few minutes on 2 cores. Slow, besides
tests marked by hand (each over ~3 s on a loaded 2-core machine): every end-to-end test (real
`gearshift serve` processes) and every test that starts a multi-process worker group, a replica
group, the operator as a process, or kills a rank (the fixtures below).
"""

from __future__ import annotations

import os

import pytest

# gearshift.worker.p2p.rules.COMM_RULES_ENV, spelled out: this file imports no torch.
COMM_RULES_ENV = "GEARSHIFT_COMM_RULES"

SLOW_FIXTURES = frozenset({"group_factory", "replica_factory", "operator_process", "victim"})


def _import_triton_for_its_interpreter() -> None:
    """Without CUDA, Triton kernels run only in Triton's interpreter, and triton wraps its own
    library (tl.max, tl.sum) for one mode when it is imported: import it here, before any test
    does, with the interpreter chosen. The variable is restored, so only tests that set it
    (in-process, or for the processes they start) run kernels interpreted."""
    import importlib.util
    import os

    if importlib.util.find_spec("triton") is None:
        return
    import torch

    if torch.cuda.is_available():
        return
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


_import_triton_for_its_interpreter()


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow = pytest.mark.slow
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if item.nodeid.startswith("tests/e2e/") or fixtures & SLOW_FIXTURES:
            item.add_marker(slow)
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Every group a test starts (its rank processes inherit the environment) holds its gloo
    traffic to NCCL's point-to-point rules (worker/p2p/rules.py), set before any fixture of
    the test starts one. No test is exempt."""
    os.environ[COMM_RULES_ENV] = "nccl"
