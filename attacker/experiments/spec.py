"""What an experiment is: the experiment files parsed into cells, the cells a command line selects,
and each cell's ``attacker run`` config.

An experiment file lists its cells explicitly (``cells:``), as *grids* (``grids:``: axes expanded as a
cartesian product, plus exceptions; see :func:`expand_grid`), or both: the cells come in file order.
"""

from __future__ import annotations

import fnmatch
import math
from pathlib import Path
from typing import Any

import yaml

from fedsim.data import PAPER_VICTIMS, VictimFileError, paper_victims
from fedsim.run_config import RunConfigError, resolve_config, to_run_config

from ..config import ConfigError, RunConfig, parse_config
from .cells import CELL_KEYS, Cell, Experiment, ExperimentError, Settings
from .cells import need as _need
from .grids import DEFAULT_ID, cell_entries, expand_grid, format_id

EXPERIMENT_KEYS = {
    "name",
    "title",
    "source",
    "victims",
    "attack_overrides",
    "metrics",
    "accuracy",
    "figures",
    "cells",
    "grids",
}
# Set by the cell itself, so not in its ``federation`` settings.
_FEDERATION_FIXED = {"model", "dataset", "p", "model-options", "run-dir", "data-root"}
METRICS = {"ssim", "mmd"}  # the paper's per-cell metrics we compare; ssim in the paper's space
FIGURE_KEYS = {"name", "metric", "x", "series", "panel", "attack"}


__all__ = ["Cell", "Experiment", "ExperimentError", "Settings", "expand_grid", "load_experiment", "parse_experiment"]


def load_experiment(path: str | Path) -> Experiment:
    path = Path(path)
    if not path.is_file():
        raise ExperimentError(f"experiment file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ExperimentError(f"{path} is not valid YAML: {str(err).splitlines()[0]}") from None
    return parse_experiment(data, path)


def parse_experiment(data: dict[str, Any], path: Path | None = None) -> Experiment:
    where = str(path or "experiment")
    _need(isinstance(data, dict), where, "must be a mapping")
    unknown = sorted(set(data) - EXPERIMENT_KEYS)
    _need(not unknown, where, f"unknown key(s) {unknown}; allowed: {sorted(EXPERIMENT_KEYS)}")
    name = data.get("name") or (path.stem if path else "")
    _need(isinstance(name, str) and name and "/" not in name, where, "name must be a non-empty string without '/'")
    metrics = list(data.get("metrics") or ["ssim"])
    _need(set(metrics) <= METRICS, where, f"metrics must be among {sorted(METRICS)}, got {metrics}")
    for key in ("victims", "attack_overrides"):
        _need(isinstance(data.get(key) or {}, dict), where, f"{key} must be a mapping")
    figures = list(data.get("figures") or [])
    for fig in figures:
        _need(
            isinstance(fig, dict) and {"name", "metric", "x", "series"} <= set(fig) and set(fig) <= FIGURE_KEYS,
            where,
            f"each figure needs name, metric, x, series (optional panel, attack); got {fig}",
        )
    accuracy = data.get("accuracy")
    _need(accuracy is None or isinstance(accuracy, dict), where, "accuracy must be a mapping")
    cells, seen = [], set()
    for cw, raw in cell_entries(data, where):
        cell = _parse_cell(name, cw, raw)
        _need(cell.id not in seen, cw, f"duplicate id {cell.id!r}")
        seen.add(cell.id)
        cells.append(cell)
    return Experiment(
        name,
        str(data.get("title") or name),
        str(data.get("source") or ""),
        dict(data.get("victims") or {}),
        dict(data.get("attack_overrides") or {}),
        metrics,
        accuracy,
        figures,
        cells,
        path,
    )


def _parse_cell(experiment: str, cw: str, raw: Any) -> Cell:
    """One cell of an experiment file (explicit, or expanded from a grid), checked."""
    _need(isinstance(raw, dict), cw, "must be a mapping")
    unknown = sorted(set(raw) - CELL_KEYS)
    _need(not unknown, cw, f"unknown key(s) {unknown}; allowed: {sorted(CELL_KEYS)}")
    for key in ("model", "dataset", "p", "attacks"):
        _need(key in raw, cw, f"missing {key}")
    p = raw["p"]
    _need(isinstance(p, (int, float)) and not isinstance(p, bool), cw, f"p must be a number, got {p!r}")
    b = raw.get("victim_batch_size", 1)
    _need(
        isinstance(b, int) and not isinstance(b, bool) and b > 0,
        cw,
        f"victim_batch_size must be a positive integer, got {b!r}",
    )
    attacks = raw["attacks"]
    _need(
        isinstance(attacks, list) and attacks and all(isinstance(a, str) for a in attacks),
        cw,
        "attacks must be a non-empty list of attack names",
    )
    cid = str(raw.get("id") or format_id(DEFAULT_ID, raw, {}, cw))
    _need(all(c.isalnum() or c in "-_.+" for c in cid), cw, f"id {cid!r} may hold only letters, digits and -_.+")
    paper = raw.get("paper") or {}
    _need(isinstance(paper, dict), cw, "paper must be a mapping")
    for key, value in paper.items():
        if key == "accuracy":
            _need(value is None or isinstance(value, (int, float)), cw, "paper.accuracy must be a number or null")
            continue
        _need(
            isinstance(value, dict) and set(value) <= METRICS,
            cw,
            f"paper.{key} must map metrics {sorted(METRICS)} to values (null when unknown)",
        )
    for key in ("overrides", "model_options", "victims", "federation"):
        _need(isinstance(raw.get(key) or {}, dict), cw, f"{key} must be a mapping")
    federation = dict(raw.get("federation") or {})
    fixed = sorted(set(to_run_config(federation)) & _FEDERATION_FIXED)
    _need(not fixed, cw, f"federation must not set {', '.join(fixed)} (the cell sets them)")
    try:
        resolve_config(to_run_config(federation))
    except RunConfigError as err:
        raise ExperimentError(f"{cw}: federation: {err}") from None
    return Cell(
        experiment,
        cid,
        str(raw["model"]),
        str(raw["dataset"]),
        float(p),
        int(b),
        list(attacks),
        dict(raw.get("overrides") or {}),
        dict(raw.get("model_options") or {}),
        dict(raw.get("victims") or {}),
        bool(raw.get("optional", False)),
        dict(paper),
        federation,
    )


def _resolve_victim_file(dataset: str, data_root: str) -> Path:
    """The paper's victims of ``dataset`` under the data folder, fetched on first use (one line if not)."""
    return paper_victims(dataset, data_root, log=print).resolve()


def cell_config(exp: Experiment, cell: Cell, settings: Settings) -> dict[str, Any]:
    """The ``attacker run`` config mapping of one cell under the command line's settings."""
    victims: dict[str, Any] = {"source": "builtin", "count": 128, "data_root": settings.data_root}
    victims.update(exp.victims)
    victims.update(cell.victims)
    if cell.federated(settings):
        victims["source"], victims["captures"] = "captures", str(Path(settings.federation_dir) / cell.key)
        victims.pop("file", None)
    elif settings.victim_source == "paper" and "source" not in cell.victims and cell.dataset in PAPER_VICTIMS:
        try:
            path = _resolve_victim_file(cell.dataset, settings.data_root)
        except VictimFileError as err:
            raise ExperimentError(f"cell {cell.key}: {err}; or use --victim-source builtin") from None
        victims["source"], victims["file"] = "file", str(path)
    elif settings.victim_source == "builtin":
        victims["source"] = "builtin"
        victims.pop("file", None)
    count = settings.victims if settings.victims is not None else int(victims.get("count", 128))
    victims["count"] = max(cell.B, math.ceil(count / cell.B) * cell.B)
    victims.update(
        model=cell.model,
        dataset=cell.dataset,
        p=cell.p,
        victim_batch_size=cell.B,
        model_options=dict(cell.model_options),
    )
    overrides = dict(exp.attack_overrides)
    overrides.update(cell.overrides)
    if settings.iterations is not None:
        overrides["max_iterations"] = settings.iterations
    return {
        "victims": victims,
        "attacks": list(cell.attacks),
        "attack_overrides": overrides,
        "device": settings.device,
        "lpips": settings.lpips,
        "seed": settings.seed,
        "profile": settings.profile,
        # A grid crosses attacks with models: one that cannot take a cell's captures (dia_span on LeNet,
        # with no first Linear) is skipped with its reason in the cell's closed_form.json, as the audit
        # does, rather than failing the cell and the attacks that do apply.
        "skip_inapplicable": True,
    }


def build_cell_config(exp: Experiment, cell: Cell, settings: Settings) -> RunConfig:
    try:
        return parse_config(cell_config(exp, cell, settings))
    except ExperimentError:
        raise
    except ConfigError as err:
        raise ExperimentError(f"cell {cell.key}: {err}") from None


def select_cells(experiments: list[Experiment], settings: Settings) -> list[tuple[Experiment, Cell]]:
    """The cells to run: those matching --cells, on '<experiment>-<cell>' or '<cell>'. A glob matches as a
    glob; a plain word matches exactly when some cell has that id, else as a substring. Optional cells
    run only with --include-optional or when a pattern names them."""
    ids = {name for exp in experiments for c in exp.cells for name in (c.key, c.id)}
    patterns = [p if any(ch in p for ch in "*?[") or p in ids else f"*{p}*" for p in settings.cells]
    chosen = []
    for exp in experiments:
        for cell in exp.cells:
            hit = any(fnmatch.fnmatchcase(cell.key, p) or fnmatch.fnmatchcase(cell.id, p) for p in patterns)
            if patterns and not hit:
                continue
            if cell.optional and not (settings.include_optional or hit):
                continue
            chosen.append((exp, cell))
    return chosen
