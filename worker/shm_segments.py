"""Named POSIX shared-memory segments of a worker group: one naming rule and one stale clean-up
for every policy that shares host memory between a node's ranks (Seesaw's host KV tier, SiDP's
FFN weights).

A segment is ``/dev/shm/<prefix><key>-<creator pid>-<random><suffix>``. The key (the group's
name, ``$GEARSHIFT_GROUP_NAME``) keeps two deployments apart and the random part two starts of
one group, so a name is never fixed. The creator unlinks its segments when the group ends; a
creator that was SIGKILLed cannot, so the next start unlinks every segment of its prefix (and
key) whose creator pid is no longer alive. A creator that ends itself at once (``hard_exit``: a
watchdog verdict, a failed rank; ``os._exit`` runs no ``finally``) unlinks what it owns first.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import NoReturn

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
GROUP_NAME_ENV = "GEARSHIFT_GROUP_NAME"
_KEY_CHARS = re.compile(r"[^A-Za-z0-9_.]")

_owned: set[Path] = set()  # segments this process created and has not unlinked yet
_owned_lock = threading.Lock()


def own(path: Path) -> None:
    """Record a segment this process created (``hard_exit`` unlinks it)."""
    with _owned_lock:
        _owned.add(path)


def unlink(path: Path) -> None:
    """Unlink a segment this process created, and forget it."""
    with _owned_lock:
        _owned.discard(path)
    path.unlink(missing_ok=True)


def unlink_owned() -> list[Path]:
    """Unlink every segment this process still owns (before an exit that runs no clean-up)."""
    with _owned_lock:
        paths = sorted(_owned)
        _owned.clear()
    for path in paths:
        try:
            path.unlink(missing_ok=True)
        except OSError:  # best effort: the next start's clean_stale removes what is left
            log.debug("could not unlink %s", path, exc_info=True)
    return paths


def hard_exit(code: int) -> NoReturn:
    """End this process now (``os._exit``: no ``finally``, no atexit, no thread joins) after
    unlinking the shared-memory segments it created: a rank blocked in a collective can only be
    ended this way, and its group's segments must not outlive it."""
    unlink_owned()
    os._exit(code)


def safe_key(text: str, limit: int = 60) -> str:
    """``text`` as a name part: no ``-`` (the field separator) and no path characters."""
    return _KEY_CHARS.sub("_", text)[:limit] or "group"


def group_key(env: dict[str, str] | None = None) -> str:
    """The key of this process's group: the operator's group name, else ``local``."""
    return safe_key((env if env is not None else os.environ).get(GROUP_NAME_ENV) or "local")


def segment_name(prefix: str, key: str, suffix: str = "") -> str:
    """A new segment name for this process (the creator)."""
    return f"{prefix}{safe_key(key)}-{os.getpid()}-{secrets.token_hex(6)}{suffix}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def segments(prefix: str, key: str | None = None, shm_dir: Path = SHM_DIR) -> list[str]:
    """Names of existing segments with ``prefix`` (and ``key``), sorted."""
    if not shm_dir.is_dir():
        return []
    start = prefix + (f"{safe_key(key)}-" if key is not None else "")
    return sorted(e.name for e in shm_dir.iterdir() if e.name.startswith(start))


def created_by(names: Iterable[str], pids: Iterable[int]) -> list[str]:
    """The names among ``names`` whose creator (the pid ``segment_name`` put in) is in ``pids``:
    a check for one group's leaks that another group running beside it cannot fail."""
    wanted = {int(p) for p in pids}
    pattern = re.compile(r"-(\d+)-[0-9a-f]+(?:-|$)")
    out = []
    for name in names:
        m = pattern.search(name)
        if m is not None and int(m.group(1)) in wanted:
            out.append(name)
    return out


def clean_stale(prefix: str, key: str | None = None, shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink the segments of ``prefix`` (and ``key``) whose creator is gone; their names."""
    key_pattern = re.escape(safe_key(key)) if key is not None else r"[A-Za-z0-9_.]+"
    pattern = re.compile(rf"^{re.escape(prefix)}{key_pattern}-(\d+)-[0-9a-f]+(?:-.*)?$")
    removed: list[str] = []
    for name in segments(prefix, key, shm_dir):
        m = pattern.match(name)
        if m and not pid_alive(int(m.group(1))):
            (shm_dir / name).unlink(missing_ok=True)
            removed.append(name)
    if removed:
        log.warning("removed shared-memory segments of a dead group: %s", ", ".join(removed))
    return removed
