"""Network probes with a hard wall-clock limit, so that nothing hangs on a machine without network.

A socket timeout bounds each read and connect but not DNS resolution, which can block for
minutes offline; so the probe runs in a daemon thread joined with a deadline. An abandoned probe
thread dies with the process.
"""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def call_with_deadline(fn: Callable[[], T], timeout_s: float, name: str = "fedsim-probe") -> T:
    """``fn()`` run in a daemon thread joined with a deadline: its result, or what it raised, or
    TimeoutError past ``timeout_s`` seconds (the thread is abandoned and dies with the process)."""
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            outcome.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def probe_url(url: str, timeout_s: float) -> None:
    """Send ``url`` a HEAD request; return when it answers with a status below 400 within
    ``timeout_s`` seconds (DNS included), else raise: :class:`TimeoutError` past the deadline,
    :class:`OSError` for an error status, or whatever the request raised."""

    def head() -> int:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout_s) as response:
            return int(getattr(response, "status", 200))

    try:
        status = call_with_deadline(head, timeout_s, "fedsim-url-probe")
    except TimeoutError:
        raise TimeoutError(f"{url} did not answer within {timeout_s:g} s") from None
    if not 200 <= status < 400:
        raise OSError(f"{url} answered HTTP {status}")


def url_reachable(url: str, timeout_s: float) -> bool:
    """Whether :func:`probe_url` succeeds: any failure just means "not reachable"."""
    try:
        probe_url(url, timeout_s)
    except Exception:  # noqa: BLE001
        return False
    return True
