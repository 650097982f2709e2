"""The C++ build of Algorithm 1 (``cdsp_native.cpp``), compiled on first use into an extension
module.

The router plans every Tetris request on its event loop, and the paper's bar is tens of
microseconds per request (Table 2); the Python search takes a few hundred. The C++ file is the
same search in the same floating-point order, so both give the same plans; ``cdsp.plan_request``
uses it once it has loaded (the first call starts the build in the background and plans in
Python meanwhile) and falls back to Python when it cannot be built (no C++ compiler or Python
headers, a failed build).

``GEARSHIFT_PLANNER``: ``python`` never loads it, ``native`` makes a failed build an error
(default: try, fall back with one warning). The module lands in ``$GEARSHIFT_PLANNER_CACHE``
(default ``~/.cache/gearshift/planner``) under a name keyed by the source, the compiler, the
flags and the Python ABI, written to a temporary name and renamed, so concurrent first uses
never load a half-written file. No torch and no numpy: the router imports this.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gearshift.operator.planner.latency_model import LatencyModel

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cdsp_native.cpp")
MODULE = "gearshift_cdsp_native"
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math")


class NativeBuildError(RuntimeError):
    """The C++ planner could not be compiled or loaded; the message says why."""


def cache_root() -> Path:
    override = os.environ.get("GEARSHIFT_PLANNER_CACHE")
    return Path(override) if override else Path.home() / ".cache" / "gearshift" / "planner"


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def build(root: Path | None = None) -> Path:
    """The compiled module's path, compiling it when no cached build matches."""
    cxx = compiler()
    if cxx is None:
        raise NativeBuildError("no C++ compiler (set CXX or install g++)")
    include = sysconfig.get_paths()["include"]
    if not Path(include, "Python.h").exists():
        raise NativeBuildError(f"no Python headers in {include}")
    flags = (*FLAGS, f"-I{include}")
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    key = hashlib.sha256(
        SOURCE.read_bytes() + "\0".join((cxx, *flags, suffix)).encode()
    ).hexdigest()[:16]
    root = root or cache_root()
    final = root / f"{MODULE}-{key}{suffix}"
    if final.exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{MODULE}-", suffix=".tmp", dir=root)
    os.close(fd)
    try:
        done = subprocess.run(
            [cxx, *flags, str(SOURCE), "-o", tmp],
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        if done.returncode != 0:
            raise NativeBuildError(f"{cxx} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, final)
    except subprocess.TimeoutExpired as exc:
        raise NativeBuildError(f"{cxx} did not finish in 180 s") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return final


def load(path: Path) -> Any:
    """The extension module at ``path`` (its init function is named after ``MODULE``)."""
    spec = importlib.util.spec_from_file_location(MODULE, path)
    if spec is None or spec.loader is None:
        raise NativeBuildError(f"cannot load {path} as an extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_LOCK = threading.Lock()  # one build at a time in this process
_LOADED: list[Any] = []  # [the module, or None when it cannot be built], once decided
_BACKGROUND: list[threading.Thread] = []


def planner() -> Any | None:
    """The native module, building it if needed (blocks for the build), or None when it is off
    or cannot be built (warned once)."""
    mode = os.environ.get("GEARSHIFT_PLANNER", "")
    if mode == "python":
        return None
    with _LOCK:
        if not _LOADED:
            try:
                _LOADED.append(load(build()))
            except (NativeBuildError, OSError, ImportError) as exc:
                if mode == "native":
                    raise NativeBuildError(
                        f"the C++ CDSP planner is required but failed: {exc}"
                    ) from exc
                log.warning("CDSP planner: using the Python search (%s)", exc)
                _LOADED.append(None)
        return _LOADED[0]


def ready() -> Any | None:
    """The native module if it is loaded; otherwise start loading it on a background thread and
    return None, so a caller on an event loop (the router) plans in Python for the few seconds a
    first build takes instead of stalling. ``GEARSHIFT_PLANNER=native`` waits for it instead."""
    if _LOADED:
        return _LOADED[0]
    mode = os.environ.get("GEARSHIFT_PLANNER", "")
    if mode == "native":
        return planner()
    if mode == "python":
        return None
    if not _BACKGROUND:
        thread = threading.Thread(target=planner, name="cdsp-native-build", daemon=True)
        _BACKGROUND.append(thread)
        thread.start()
    return None


_MODELS: dict[int, tuple[Mapping[int, LatencyModel], tuple[Any, Any]]] = {}


def _models(models: Mapping[int, LatencyModel]) -> tuple[Any, Any]:
    """(sizes, flat coefficients) of a rules' models, converted once per models object."""
    hit = _MODELS.get(id(models))
    if hit is not None and hit[0] is models:
        return hit[1]
    sizes = tuple(models)
    coef = tuple(float(v) for m in models.values() for v in (m.a, m.b, m.c, m.d))
    if len(_MODELS) > 64:
        _MODELS.clear()
    _MODELS[id(models)] = (models, (sizes, coef))
    return sizes, coef


def plan(
    module: Any,
    length: int,
    queue: Mapping[int, float],
    node_of: Sequence[int],
    models: Mapping[int, LatencyModel],
    granularity: int,
    max_chunks: int,
    improvement_rate: float,
) -> list[tuple[int, tuple[int, ...], float, float]] | None:
    """Algorithm 1 for a request of ``length`` tokens on the pool given by ``queue`` (T by
    instance id) and ``node_of``: chunks as (length, group, wait after the previous chunk,
    seconds); None when no SP size fits the pool."""
    sizes, coef = _models(models)
    if not isinstance(queue, dict):
        queue = dict(queue)
    result: list[tuple[int, tuple[int, ...], float, float]] | None = module.plan(
        length, queue, node_of, sizes, coef, granularity, max_chunks, improvement_rate
    )
    return result
