"""Network probes with a hard wall-clock limit, so that nothing hangs on a machine without network.

A socket timeout bounds each read and connect but not DNS resolution, which can block for
minutes offline; so the probe runs in a daemon thread joined with a deadline. An abandoned probe
thread dies with the process.
"""

from __future__ import annotations

import threading
import urllib.request


def probe_url(url: str, timeout_s: float) -> None:
    """Send ``url`` a HEAD request; return when it answers with a status below 400 within
    ``timeout_s`` seconds (DNS included), else raise: :class:`TimeoutError` past the deadline,
    :class:`OSError` for an error status, or whatever the request raised."""
    outcome: list[BaseException | None] = []

    def head() -> None:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout_s) as response:
                status = getattr(response, "status", 200)
            outcome.append(None if 200 <= status < 400 else OSError(f"{url} answered HTTP {status}"))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            outcome.append(exc)

    thread = threading.Thread(target=head, name="fedsim-url-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        raise TimeoutError(f"{url} did not answer within {timeout_s:g} s")
    if outcome[0] is not None:
        raise outcome[0]


def url_reachable(url: str, timeout_s: float) -> bool:
    """Whether :func:`probe_url` succeeds: any failure just means "not reachable"."""
    try:
        probe_url(url, timeout_s)
    except Exception:  # noqa: BLE001
        return False
    return True
