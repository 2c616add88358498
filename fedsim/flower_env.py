"""The environment Flower runs under here: no telemetry, no update check, no runtime installs.

Flower reads some of these when it is imported, so every module that imports flwr calls
:func:`apply` first; subprocesses (the deployment's SuperLink and SuperNodes, test runs) get
:data:`FLWR_ENV` in their environment. This module imports nothing from Flower.
"""

from __future__ import annotations

import os

FLWR_ENV: dict[str, str] = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
}


def apply() -> None:
    """Set :data:`FLWR_ENV` in this process, leaving any value the user set."""
    for key, value in FLWR_ENV.items():
        os.environ.setdefault(key, value)
