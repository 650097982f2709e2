"""Build (once per source/torch/compiler/CPU combination) and load the C++ CPU kernels.

The shared library is compiled by ``torch.utils.cpp_extension``, as one translation unit that
includes every source (``unity_source``), into a cache folder keyed by a hash
of everything that changes the binary: the sources, torch's version, the compiler and its flags,
and the CPU's feature flags (``-march=native`` code must not run on another CPU model sharing the
same home directory). Builders take a file lock, compile into a private temporary folder and
rename it into place, so concurrent processes never load a half-written library.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from gearshift.worker.kernels.cpu_features import (
    ISA_ENV,
    ISA_MARCH,
    cpuinfo_flags_line,
    host_features,
    kernel_isa,
)

log = logging.getLogger(__name__)

LIBRARY = "gearshift_cpu_kernels"
SOURCES = (
    "norm.cpp",
    "elementwise.cpp",
    "attention.cpp",
    "argmax.cpp",
    "decode_layer.cpp",
    "registration.cpp",
)
HEADERS = ("common.h", "kernels.h", "simd.h")
# -ffp-contract=off: the elementwise kernels must round like torch's separate multiply and add;
# reductions that want FMA spell it (std::fma).
_X86 = platform.machine().lower() in ("x86_64", "amd64")
BASE_CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")
LDFLAGS = ("-fopenmp",)
LOCK_TIMEOUT_S = 600.0
HERE = Path(__file__).resolve().parent


class KernelBuildError(RuntimeError):
    """The kernels could not be compiled or loaded; callers fall back to torch."""


def cache_root() -> Path:
    """``$GEARSHIFT_KERNEL_CACHE``, else ``~/.cache/gearshift/kernels``."""
    override = os.environ.get("GEARSHIFT_KERNEL_CACHE")
    return Path(override) if override else Path.home() / ".cache" / "gearshift" / "kernels"


def cflags(isa: str) -> tuple[str, ...]:
    """Compiler flags for kernels targeting ``isa`` (cpu_features.ISA_MARCH).

    The hand-written AVX-512 paths compile only where the target has AVX-512 (``#if
    __AVX512F__``); on AVX2 or older targets every kernel runs its portable loop, which the
    compiler vectorises for the target. On x86, GCC uses 256-bit vectors unless told otherwise:
    512-bit ones make the row kernels ~1.3x faster on AVX-512 machines.
    """
    march = ISA_MARCH[isa]
    wide = _X86 and (isa == "avx512" or (isa == "native" and host_features().avx512))
    return ("-march=" + march, *(("-mprefer-vector-width=512",) if wide else ()), *BASE_CFLAGS)


def describe(isa: str) -> str:
    """Which code paths a build for ``isa`` runs, for the log."""
    features = host_features()
    avx512 = isa == "avx512" or (isa == "native" and features.avx512)
    if avx512:
        return f"{isa}: hand-written AVX-512 paths"
    return f"{isa}: no AVX-512 on the target, every kernel runs its portable (auto-vectorised) loop"


def build_key(isa: str = "native") -> str:
    """Hash of everything that makes a different binary."""
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode())
        h.update((HERE / name).read_bytes())
    for part in (
        torch.__version__,
        os.environ.get("CXX", "c++"),
        " ".join(cflags(isa) + LDFLAGS),
        platform.machine(),
        cpuinfo_flags_line(),
        sys.version,
    ):
        h.update(part.encode())
    return h.hexdigest()[:20]


@contextlib.contextmanager
def _file_lock(path: Path, timeout_s: float) -> Iterator[bool]:
    """Exclusive flock on ``path``; yields False if it was not granted within ``timeout_s``."""
    with open(path, "a+") as f:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    yield False
                    return
                time.sleep(0.2)
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """cpp_extension runs ``ninja`` from PATH; the pip package's binary may sit only in the venv."""
    if shutil.which("ninja") is not None:
        yield
        return
    old = os.environ.get("PATH", "")
    try:
        import ninja

        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, old])
    except ImportError:
        pass
    try:
        yield
    finally:
        os.environ["PATH"] = old


def unity_source(build_dir: Path) -> Path:
    """One translation unit that includes every source. Each source alone spends 5-9 s of CPU
    parsing torch's headers and 1-3 s compiling its own code: six of them took about 60 s of
    CPU (36 s on 2 cores), one unit takes about 14 s. The sources share no name (their helpers
    sit in anonymous namespaces that merge here, so a clash is a compile error, not a silent
    change) and define no macros."""
    unit = build_dir / f"{LIBRARY}_all.cpp"
    unit.write_text("".join(f'#include "{HERE / name}"\n' for name in SOURCES))
    return unit


def _compile(build_dir: Path, isa: str) -> Path:
    from torch.utils import cpp_extension

    with _ninja_on_path():
        cpp_extension.load(
            LIBRARY,
            [str(unity_source(build_dir))],
            extra_cflags=list(cflags(isa)),
            extra_ldflags=list(LDFLAGS),
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    return build_dir / f"{LIBRARY}.so"


def load_library() -> Path:
    """Load the kernels into this process (building them first if needed); returns the .so path.

    Raises ``KernelBuildError`` when the ISA cannot run here, or the compiler, ninja, the build or
    the loader fails.
    """
    try:
        isa = kernel_isa()
    except ValueError as e:
        raise KernelBuildError(str(e)) from e
    if not host_features().can_run_isa(isa):
        raise KernelBuildError(f"{ISA_ENV}={isa} needs CPU flags this host lacks")
    root = cache_root()
    key = build_key(isa)
    final = root / key
    library = final / f"{LIBRARY}.so"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if not library.exists():
            with _file_lock(root / f"{key}.lock", LOCK_TIMEOUT_S) as locked:
                if not locked:
                    log.warning("kernel build lock in %s busy for %.0fs", root, LOCK_TIMEOUT_S)
                if not library.exists():
                    _build_and_load(root, final, isa)
                    log.info("CPU kernels built for %s", describe(isa))
                    return library
        torch.ops.load_library(str(library))
        log.info("CPU kernels for %s", describe(isa))
    except Exception as e:  # any failure (compiler, linker, loader) means: use torch instead
        raise KernelBuildError(f"{type(e).__name__}: {e}") from e
    return library


def _build_and_load(root: Path, final: Path, isa: str) -> None:
    """Compile into a private folder (cpp_extension also loads it), then rename it into place."""
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f"{final.name}.build-", dir=root))
    try:
        _compile(tmp, isa)
        try:
            tmp.rename(final)
        except OSError:
            # Another builder (one that timed out on the lock) got there first: same binary.
            if not (final / f"{LIBRARY}.so").exists():
                raise
        log.info("built CPU kernels in %.1fs into %s", time.monotonic() - started, final)
    finally:
        # The loaded library stays mapped after its file is removed or renamed.
        shutil.rmtree(tmp, ignore_errors=True)
