"""The command line's output files: checked before any work (``check``), and written whole or
not at all (``replacing``): a failure leaves neither a partial file nor a stale temporary."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Collection, Iterator
from pathlib import Path


def check(path: Path, flag: str, suffixes: Collection[str] | None = None) -> None:
    """Refuse, naming ``flag``, an output path that cannot be written: an empty one, a
    directory, something other than a regular file, one whose directory is missing or not
    writable, or (``suffixes``, lower case without the dot) one of another extension."""
    if not str(path):
        raise ValueError(f"{flag}: an empty path")
    target = Path(os.path.realpath(path))
    if target.is_dir():
        raise ValueError(f"{flag} {path}: is a directory; give a file path")
    if target.exists() and not target.is_file():
        raise ValueError(f"{flag} {path}: not a regular file")
    parent = target.parent
    if not parent.is_dir():
        raise ValueError(f"{flag} {path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: the directory {parent} is not writable")
    if suffixes is not None and target.suffix.lower().lstrip(".") not in suffixes:
        known = ", ".join(f".{s}" for s in sorted(suffixes))
        raise ValueError(f"{flag} {path}: the file name must end in one of {known}")


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary file beside ``path`` (the same extension) to write; renamed over ``path``
    when the block ends, removed when it raises."""
    target = Path(os.path.realpath(path))
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=target.suffix, dir=target.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, _mode(target))
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_text(path: Path, text: str) -> None:
    """``path.write_text(text)``, whole or not at all."""
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def _mode(target: Path) -> int:
    """The mode a plain write would leave: the file's own, else 0666 less the umask."""
    with contextlib.suppress(OSError):
        return stat.S_IMODE(target.stat().st_mode)
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask
