"""Shared pytest configuration: GPU tests skip cleanly without CUDA, what counts as slow, and
the point-to-point rules every test runs under.

`make test-fast` runs `-m "not slow"`: the unit tests, a few minutes on 2 cores. Slow, besides
tests marked by hand (each over ~3 s on a loaded 2-core machine): every end-to-end test (real
`gearshift serve` processes) and every test that starts a multi-process worker group, a replica
group, the operator as a process, or kills a rank (the fixtures below).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# gearshift.worker.p2p.rules.COMM_RULES_ENV, spelled out: this file imports no torch.
COMM_RULES_ENV = "GEARSHIFT_COMM_RULES"

SLOW_FIXTURES = frozenset({"group_factory", "replica_factory", "operator_process", "victim"})

# The one test that needs vLLM's venv (tests/e2e/vllm_env.py), and the markers it carries.
VLLM_TEST = Path(__file__).parent / "e2e" / "test_vllm_backend.py"
VLLM_TEST_MARKERS = frozenset({"slow", "timeout"})
_PREINSTALL = pytest.StashKey["subprocess.Popen[bytes]"]()


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


def _selects_the_vllm_test(config: pytest.Config) -> bool:
    """Whether this run's paths and marker expression take in the vLLM test (a -k expression
    is not evaluated: such a run is taken not to)."""
    if config.option.keyword:
        return False
    markexpr = config.option.markexpr or ""
    if markexpr:
        # pytest's own marker-expression parser is private (_pytest): should a release move or
        # change it, the run is taken not to select the test, and the test installs its venv
        # when it asks (slower, never wrong).
        try:
            from _pytest.mark.expression import Expression

            selected = Expression.compile(markexpr).evaluate(
                lambda name, **_: name in VLLM_TEST_MARKERS
            )
        except Exception:  # noqa: BLE001 - any change in the private API
            return False
        if not selected:
            return False
    here = config.invocation_params.dir
    for arg in config.args or [str(here)]:
        path = (here / arg.split("::")[0]).resolve()
        if path == VLLM_TEST or path in VLLM_TEST.parents:
            return True
    return False


def pytest_sessionstart(session: pytest.Session) -> None:
    """vLLM's venv takes minutes to install on a fresh machine (CI). When this run selects the
    test that needs it, the install starts now in the background, in the xdist controller (or
    the only process), so it overlaps the tests before that one; the test's own
    ``ensure_vllm`` waits on the same lock and finds it made. Set GEARSHIFT_VLLM_PREINSTALL=0
    to install only when the test asks."""
    config = session.config
    if hasattr(config, "workerinput") or os.environ.get("GEARSHIFT_VLLM_PREINSTALL") == "0":
        return
    if not _selects_the_vllm_test(config):
        return
    from tests.e2e.vllm_env import venv_dir

    log = venv_dir().parent / f".{venv_dir().name}.preinstall.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        config.stash[_PREINSTALL] = subprocess.Popen(
            [sys.executable, "-m", "tests.e2e.vllm_env"],
            cwd=Path(__file__).parents[1],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def pytest_unconfigure(config: pytest.Config) -> None:
    """An install still running when the run ends (the run stopped early) is ended with it; a
    half-made venv has no completion stamp and is made again next time."""
    proc = config.stash.get(_PREINSTALL, None)
    if proc is not None:
        from tests.e2e.vllm_env import end_process_group

        end_process_group(proc, 30)


@pytest.fixture(scope="session")
def smollm2_hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded SmolLM2 GGUF as transformers loads it (its own dequantisation, fp32), saved
    as a safetensors folder with the tokenizer (``benchmarks/export_smollm2.py``). The load takes
    about 20 s of CPU, so it runs once a run: the xdist workers share the folder (the run's base
    temp folder holds it, under a lock), and a fp32 reload gives the same tensors bit for bit."""
    import fcntl

    from benchmarks.export_smollm2 import export

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder = root / "smollm2-hf-fp32"
    with open(root / "smollm2-hf-fp32.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "config.json").is_file():
            partial = root / "smollm2-hf-fp32.partial"
            export(partial, "float32")
            partial.rename(folder)
    return folder
