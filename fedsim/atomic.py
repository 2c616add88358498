"""Atomic writes: a file or folder appears complete under its name, or not at all.

Everything is first written under a hidden temporary name in the destination's folder (so the
rename stays on one file system) and then renamed into place with :func:`os.replace`; on any
failure the temporary file or folder is removed and the previous content, if any, is kept.

* :func:`atomic_write` -- bytes or text to a file;
* :func:`atomic_path` -- a temporary file path for writers that want a path of their own
  (``trainer.save_checkpoint``, a download), renamed into place when the ``with`` block succeeds;
* :func:`atomic_folder` -- the same for a folder of files (a capture record), fsynced by default.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


@contextmanager
def atomic_path(path: str | Path, *, suffix: str = ".tmp", fsync: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary file next to ``path``; on success it replaces ``path``, on failure
    (an exception in the block, or a failed rename) it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        if fsync:
            _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write(path: str | Path, data: bytes | str, *, fsync: bool = False) -> None:
    """Write ``data`` (text is UTF-8 encoded) to ``path`` atomically: no half-written file is ever seen."""
    with atomic_path(path, fsync=fsync) as tmp:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_TRUNC), "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)


@contextmanager
def atomic_folder(path: str | Path, *, fsync: bool = True) -> Iterator[Path]:
    """Yield a fresh temporary folder next to ``path``; when the block succeeds its files are fsynced
    (durable before the rename makes them visible) and it is renamed to ``path``; on failure it is
    removed. ``path`` must not exist yet (a folder cannot replace a non-empty folder)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        if fsync:
            for file in sorted(tmp.iterdir()):
                if file.is_file():
                    _fsync_file(file)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
