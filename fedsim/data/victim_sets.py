"""The paper's own victim images: fetched by URL with a pinned SHA-256 into the data folder.

The authors published the 128 MNIST and 128 CIFAR-10 images they attacked in their repository; the
project never ships them. :func:`paper_victims` returns the local file, fetching it on first use:
one HTTP GET under a hard wall-clock limit (DNS included), the bytes checked against the pinned
hash before they are written, atomically, under ``<data-root>/dia-victims/``. A file already there
is used only when its hash matches. Every failure is a one-line :class:`VictimFileError` naming the
file and what to do.

Downloads are off when ``DLA_OFFLINE=1`` (or ``allow_download=False``); ``DLA_VICTIMS_URL`` points
the fetch at a mirror (a base URL holding the same file names). ``fedsim victims`` (``make victims``)
fetches both sets.
"""

from __future__ import annotations

import functools
import hashlib
import os
import urllib.request
from collections.abc import Callable
from pathlib import Path

from fedsim.atomic import atomic_write
from fedsim.net import call_with_deadline

# The victim sets are entries of the dataset table; PAPER_VICTIMS is re-exported from here, where it
# has always been read (and where tests pin it).
from .catalog import PAPER_VICTIMS, VictimSet
from .errors import VictimFileError

# The authors' repository at the commit the paper's victims were taken from; github.com resolves the
# short commit id. The hashes pinned in the dataset table, not the URL, are what make the files the paper's.
DEFAULT_BASE_URL = "https://github.com/dAI-SY-Group/DropoutInversionAttack/raw/aa5c00c/data/"
FOLDER = "dia-victims"
OFFLINE_ENV = "DLA_OFFLINE"
URL_ENV = "DLA_VICTIMS_URL"
FETCH_TIMEOUT_S = 20.0
_MAX_BYTES = 16 * 2**20  # both files are under 2 MB: anything far larger is not them


def downloads_allowed() -> bool:
    """False when the user turned downloads off with ``DLA_OFFLINE=1`` (any value but '', 0, false, no)."""
    return os.environ.get(OFFLINE_ENV, "").strip().lower() in ("", "0", "false", "no")


def victim_set(dataset: str) -> VictimSet:
    try:
        return PAPER_VICTIMS[dataset]
    except KeyError:
        raise VictimFileError(
            f"the paper has no victim set for dataset {dataset!r}; it has {', '.join(PAPER_VICTIMS)}"
        ) from None


def paper_victims_path(dataset: str, data_root: str | Path = "data") -> Path:
    """Where the paper's victims of ``dataset`` live (or will, once fetched)."""
    return Path(data_root).expanduser() / FOLDER / victim_set(dataset).filename


def source_url(dataset: str, base_url: str | None = None) -> str:
    base = base_url or os.environ.get(URL_ENV) or DEFAULT_BASE_URL
    return base.rstrip("/") + "/" + victim_set(dataset).filename


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@functools.lru_cache(maxsize=16)
def _cached_sha256(path: str, size: int, mtime_ns: int) -> str:
    """The file's hash, computed once per (path, size, mtime): an experiment asks once per cell."""
    return _sha256_of(Path(path))


def _how_to_get(s: VictimSet, path: Path) -> str:
    return (
        f"run `make victims` (or `fedsim victims`) where the network allows, "
        f"or put the authors' {s.filename} (sha256 {s.sha256}) at {path}"
    )


def _fetch(url: str, timeout_s: float) -> bytes:
    """The body of ``url``, or an exception: the whole request, DNS included, within ``timeout_s``."""

    def get() -> bytes:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            expected = response.headers.get("Content-Length")
            body = response.read(_MAX_BYTES + 1)
        if len(body) > _MAX_BYTES:
            raise OSError(f"the answer is larger than {_MAX_BYTES // 2**20} MB, not a victim file")
        if expected is not None and expected.isdigit() and int(expected) != len(body):
            raise OSError(f"partial download: {len(body):,} of {int(expected):,} bytes")
        return body

    try:
        return call_with_deadline(get, timeout_s, "fedsim-victims-fetch")
    except TimeoutError:
        raise TimeoutError(f"no complete answer within {timeout_s:g} s") from None


def fetch_paper_victims(
    dataset: str, data_root: str | Path = "data", *, base_url: str | None = None, timeout_s: float = FETCH_TIMEOUT_S
) -> Path:
    """Download the paper's victims of ``dataset`` into the data folder, checked against the pinned
    hash before anything is written (atomically): the path, or :class:`VictimFileError`."""
    s, path, url = victim_set(dataset), paper_victims_path(dataset, data_root), source_url(dataset, base_url)
    try:
        body = _fetch(url, timeout_s)
    except Exception as exc:  # noqa: BLE001 - any failure of the fetch is one line for the user
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise VictimFileError(
            f"could not fetch the paper's {dataset} victims from {url}: {reason[:200]}; {_how_to_get(s, path)}"
        ) from None
    found = hashlib.sha256(body).hexdigest()
    if found != s.sha256:
        raise VictimFileError(
            f"the file fetched from {url} has sha256 {found}, expected {s.sha256} for {s.filename}; nothing was written"
        )
    if path.parent.exists() and not path.parent.is_dir():
        raise VictimFileError(f"cannot store the paper's victims: {path.parent} is a file, not a folder")
    atomic_write(path, body, fsync=True)
    path.chmod(0o644)  # a data file like any other (the atomic write's temporary file is private)
    return path


def paper_victims(
    dataset: str,
    data_root: str | Path = "data",
    *,
    allow_download: bool | None = None,
    base_url: str | None = None,
    timeout_s: float = FETCH_TIMEOUT_S,
    log: Callable[[str], object] | None = None,
) -> Path:
    """The verified local file of the paper's victims of ``dataset``, fetched on first use.

    ``allow_download`` None follows ``DLA_OFFLINE``. Raises :class:`VictimFileError` in one line when
    the file is absent and cannot be fetched, or when the file there is not the paper's."""
    s, path = victim_set(dataset), paper_victims_path(dataset, data_root)
    if path.is_file():
        stat = path.stat()
        found = _cached_sha256(str(path.resolve()), stat.st_size, stat.st_mtime_ns)
        if found != s.sha256:
            raise VictimFileError(
                f"{path} has sha256 {found}, expected {s.sha256} (not the paper's "
                f"{s.filename}); delete it and {_how_to_get(s, path)}"
            )
        return path
    if path.exists():
        raise VictimFileError(f"{path} is not a file; remove it and {_how_to_get(s, path)}")
    allowed = downloads_allowed() if allow_download is None else allow_download
    if not allowed:
        raise VictimFileError(
            f"the paper's {dataset} victims ({path}) are not there and downloads are off "
            f"({OFFLINE_ENV}=1): {_how_to_get(s, path)}"
        )
    if log is not None:
        log(f"fetching the paper's {dataset} victims from {source_url(dataset, base_url)} into {path} ...")
    return fetch_paper_victims(dataset, data_root, base_url=base_url, timeout_s=timeout_s)
