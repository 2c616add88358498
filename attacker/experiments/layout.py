"""Where an experiment's results live under its output folder, and whether a cell's run is done."""

from __future__ import annotations

import json
from pathlib import Path

from .spec import Cell, Settings


def cell_dir(out: Path, cell: Cell) -> Path:
    """The run folder of one cell: ``OUT/cells/<experiment>-<cell>``."""
    return out / "cells" / cell.key


def run_state(run_dir: Path) -> str:
    """The status an ``attacker run`` folder's ``run.json`` holds ("finished", "running", ...), or "missing"."""
    try:
        return json.loads((run_dir / "run.json").read_text()).get("status", "unknown")
    except (OSError, ValueError):
        return "missing"


def accuracy_dir(out: Path, model: str, dataset: str, p: float, settings: Settings) -> Path:
    """One folder per federation setting, so a changed --fl-* option never reuses a stale result."""
    tag = (
        f"r{settings.fl_rounds}"
        + (f"-c{settings.fl_clients}" if settings.fl_clients else "")
        + (f"-s{settings.fl_local_steps}" if settings.fl_local_steps else "")
    )
    return out / "accuracy" / f"{model}-{dataset}-p{p:g}-{tag}"
