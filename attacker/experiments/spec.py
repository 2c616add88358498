"""What an experiment is: the experiment files parsed into cells, the cells a command line selects,
and each cell's ``attacker run`` config.

An experiment file lists its cells explicitly (``cells:``), as *grids* (``grids:``: axes expanded as a
cartesian product, plus exceptions; see :func:`expand_grid`), or both: the cells come in file order.
"""

from __future__ import annotations

import copy
import fnmatch
import itertools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fedsim.data import PAPER_VICTIMS, VictimFileError, paper_victims
from fedsim.run_config import DEFAULTS, RunConfigError, resolve_config, to_run_config
from fedsim.task import local_plan

from ..config import ConfigError, RunConfig, parse_config
from ..profiles import DEFAULT_PROFILE

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
CELL_KEYS = {
    "id",
    "model",
    "dataset",
    "p",
    "victim_batch_size",
    "attacks",
    "overrides",
    "model_options",
    "victims",
    "optional",
    "paper",
    "federation",
}
# Set by the cell itself, so not in its ``federation`` settings.
_FEDERATION_FIXED = {"model", "dataset", "p", "model-options", "run-dir", "data-root"}
METRICS = {"ssim", "mmd"}  # the paper's per-cell metrics we compare; ssim in the paper's space
FIGURE_KEYS = {"name", "metric", "x", "series", "panel", "attack"}


class ExperimentError(ConfigError):
    """An experiment file or an output folder the user must fix."""


@dataclass
class Cell:
    experiment: str
    id: str
    model: str
    dataset: str
    p: float
    victim_batch_size: int
    attacks: list[str]
    overrides: dict[str, Any] = field(default_factory=dict)
    model_options: dict[str, Any] = field(default_factory=dict)
    victims: dict[str, Any] = field(default_factory=dict)
    optional: bool = False
    paper: dict[str, Any] = field(default_factory=dict)
    # Run config settings of the cell's own federation (e.g. a defense): with them, the cell's victims
    # are that federation's captured round and its accuracy is that federation's (attacker.experiments.run).
    federation: dict[str, Any] = field(default_factory=dict)

    @property
    def B(self) -> int:
        """The paper's symbol for the victim batch size, used in labels and report columns."""
        return self.victim_batch_size

    @property
    def key(self) -> str:
        return f"{self.experiment}-{self.id}"

    @property
    def local_round(self) -> dict[str, Any] | None:
        """The victims' FedAvg round (victims.local_round), or None for the paper's one step."""
        return self.victims.get("local_round")

    @property
    def local_steps(self) -> int | None:
        """K, the local steps of the cell's FedAvg round (None: the one-step setting)."""
        if self.local_round is None:
            return None
        cfg = resolve_config(to_run_config(self.local_round))
        return len(local_plan(cfg, one_step=False, seed=0).schedule.batches(self.victim_batch_size, 0))

    @property
    def optimizer(self) -> str | None:
        return None if self.local_round is None else str(self.local_round.get("optimizer", DEFAULTS["optimizer"]))

    def local_round_label(self) -> str | None:
        r = self.local_round
        if r is None:
            return None
        return (
            f"N={self.victim_batch_size} b={r.get('batch_size', DEFAULTS['batch-size'])} "
            f"E={r.get('local_epochs', DEFAULTS['local-epochs'])} {self.optimizer} lr={r.get('lr', DEFAULTS['lr'])}"
        )

    def label(self) -> str:
        extra = "".join(f", {k}={v}" for k, v in {**self.federation, **self.overrides}.items())
        return f"{self.model}/{self.dataset} p={self.p:g} B={self.B}{extra}"


@dataclass
class Experiment:
    name: str
    title: str
    source: str
    victims: dict[str, Any]
    attack_overrides: dict[str, Any]
    metrics: list[str]
    accuracy: dict[str, Any] | None
    figures: list[dict[str, Any]]
    cells: list[Cell]
    path: Path | None = None


@dataclass
class Settings:
    """What the command line decides on top of the experiment files."""

    victims: int | None = None  # victim images per cell (rounded up to a multiple of B); None: the file's count
    iterations: int | None = None
    device: str = "auto"
    # paper: the paper's victim files; builtin: a client's partition of the dataset; federated: the
    # curious server's round-1 captures of a Flower simulation (one victim batch per client)
    victim_source: str = "paper"
    federation_dir: str = "federations"  # where federated victim sources go (under the output folder)
    data_root: str = "data"
    lpips: bool = True
    cells: list[str] = field(default_factory=list)  # patterns on "<experiment>-<cell>"
    include_optional: bool = False
    accuracy: bool = True
    fl_rounds: int = 3
    fl_local_steps: int = 0
    fl_clients: int | None = None
    progress: bool = True
    seed: int = 0
    profile: str = DEFAULT_PROFILE  # attack settings per model family (attacker.profiles)


def _need(cond: bool, where: str, msg: str) -> None:
    if not cond:
        raise ExperimentError(f"{where}: {msg}")


# ---- grids: cells from axes --------------------------------------------------------------------------

GRID_KEYS = {"id", "cell", "axes", "exceptions", "paper"}
EXCEPTION_KEYS = {"where", "set", "drop"}
DEFAULT_ID = "{model}-{dataset}-p{p}-B{victim_batch_size}"  # an explicit cell's default id, as a pattern
_MAPPING_FIELDS = {"overrides", "model_options", "victims", "federation", "paper"}  # merged key by key
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][\w.]*)(?::([^{}]*))?\}")
_CELL_DEFAULTS = {"victim_batch_size": 1, "optional": False}
_MISSING = object()


def _is_field(path: Any) -> bool:
    """A cell field (``p``) or a path into one of its mappings (``overrides.lambda_mask``)."""
    if not isinstance(path, str):
        return False
    head, dot, rest = path.partition(".")
    if dot:
        return head in _MAPPING_FIELDS and bool(rest)
    return path in CELL_KEYS - {"id"}


def _merge(base: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``new`` over ``base``, mappings key by key (base's key order kept, new keys after); lists replaced."""
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base


def _fill(cell: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """What ``cell`` does not set, from ``defaults`` (mappings key by key, appended after the cell's keys)."""
    for key, value in defaults.items():
        if key not in cell:
            cell[key] = copy.deepcopy(value)
        elif isinstance(value, dict) and isinstance(cell[key], dict):
            _fill(cell[key], value)
    return cell


def _nested(path: str, value: Any) -> dict[str, Any]:
    head, _, rest = path.partition(".")
    return {head: _nested(rest, value) if rest else value}


def _value(cell: dict[str, Any], labels: dict[str, Any], key: str) -> Any:
    """An axis's name or value at this grid point, else a cell field (or a path into one)."""
    if key in labels:
        return labels[key]
    node: Any = cell
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _CELL_DEFAULTS.get(key, _MISSING)
        node = node[part]
    return node


def _text(value: Any, spec: str = "") -> str:
    """A value in an id: floats as ``:g`` (0.0 -> 0, 0.0001 -> 0.0001) unless the pattern gives a format."""
    if spec:
        return format(value, spec)
    return f"{value:g}" if isinstance(value, float) else str(value)


def _format_id(pattern: str, cell: dict[str, Any], labels: dict[str, Any], where: str) -> str:
    def one(m: re.Match[str]) -> str:
        value = _value(cell, labels, m.group(1))
        _need(
            value is not _MISSING,
            where,
            f"id pattern {pattern!r}: {{{m.group(1)}}} is neither an axis nor a field the cells set",
        )
        try:
            return _text(value, m.group(2) or "")
        except (TypeError, ValueError) as err:
            raise ExperimentError(f"{where}: id pattern {pattern!r}: {err}") from None

    return _PLACEHOLDER.sub(one, pattern)


def _matches(want: Any, have: Any) -> bool:
    """A where value: a list matches any of its items; a string as a glob on the value's id text."""
    if isinstance(want, list):
        return any(_matches(w, have) for w in want)
    if have is _MISSING:
        return False
    if isinstance(want, str):
        return fnmatch.fnmatchcase(_text(have), want)
    if isinstance(want, bool) or isinstance(have, bool):
        return want is have
    return bool(want == have)


def _partial(part: Any, where: str, *, allow_id: bool = False) -> dict[str, Any]:
    """Cell fields that a grid's template, a named axis value or an exception sets."""
    part = {} if part is None else part
    _need(isinstance(part, dict), where, f"must be a mapping of cell fields, got {part!r}")
    allowed = CELL_KEYS if allow_id else CELL_KEYS - {"id"}
    unknown = sorted(set(map(str, part)) - allowed)
    _need(not unknown, where, f"unknown key(s) {unknown}; allowed: {sorted(allowed)}")
    return part


def expand_grid(grid: Any, where: str = "grid") -> list[tuple[str, dict[str, Any]]]:
    """The raw cells of one grid, in product order (first axis outermost), each with where it came from.

    A grid: ``axes`` (each a list of values of the cell field it is named after, dotted paths into
    overrides/federation/victims/model_options/paper allowed; or a mapping of names to cell fields,
    for settings that vary together), ``cell`` (fields every cell shares, used where the axes and
    exceptions do not set them), ``id`` (a pattern over the axes and fields, default DEFAULT_ID),
    ``exceptions`` (``where:`` axis names/fields/id -> value, list of values or glob; then ``set:``
    cell fields, or ``drop: true``; matched against the grid point, each must match a cell) and
    ``paper`` (cell id -> the paper's values, over the template's)."""
    _need(isinstance(grid, dict), where, "must be a mapping with axes (and cell, id, exceptions, paper)")
    unknown = sorted(set(map(str, grid)) - GRID_KEYS)
    _need(not unknown, where, f"unknown key(s) {unknown}; allowed: {sorted(GRID_KEYS)}")
    pattern = grid.get("id", DEFAULT_ID)
    _need(
        isinstance(pattern, str) and pattern.strip(),
        where,
        f"id must be a pattern such as '{{model}}-{{dataset}}-p{{p}}', got {pattern!r}",
    )
    template = _partial(grid.get("cell"), f"{where}: cell")
    axes = grid.get("axes")
    _need(isinstance(axes, dict) and axes, where, "axes must be a non-empty mapping of axis names to their values")
    choices = _axis_choices(axes, where)
    exceptions = _exceptions(grid.get("exceptions") or [], axes, where)
    paper = grid.get("paper") or {}
    _need(isinstance(paper, dict), where, "paper must be a mapping of cell ids to the paper's values")
    hits, made, out = [0] * len(exceptions), set(), []
    for combo in itertools.product(*choices):
        labels = {name: label for name, (label, _) in zip(axes, combo)}
        cell: dict[str, Any] = {}
        for _, part in combo:
            _merge(cell, part)
        point = _fill(copy.deepcopy(cell), template)  # what exceptions match and the id names
        cid = _format_id(pattern, point, labels, where)
        drop = False
        for j, exc in enumerate(exceptions):
            if all(
                _matches(want, cid if key == "id" else _value(point, labels, key)) for key, want in exc["where"].items()
            ):
                hits[j] += 1
                drop = drop or bool(exc.get("drop"))
                _merge(cell, exc.get("set") or {})
        if drop:
            continue
        cid = str(cell.pop("id", cid))
        if cid in paper:
            made.add(cid)
            _need(isinstance(paper[cid], dict), f"{where}: paper.{cid}", "must map attacks (and accuracy) to values")
            cell["paper"] = _merge(cell.get("paper") or {}, paper[cid])
        out.append((f"{where} cell {cid}", {"id": cid, **_fill(cell, template)}))
    for j, n in enumerate(hits):
        _need(n > 0, f"{where}: exceptions[{j}]", f"matches no cell of the grid (where {exceptions[j]['where']})")
    missing = [str(k) for k in paper if k not in made]
    _need(not missing, f"{where}: paper", f"no cell of the grid has the id(s) {missing}")
    return out


def _axis_choices(axes: dict[str, Any], where: str) -> list[list[tuple[Any, dict[str, Any]]]]:
    """Per axis, its values: (the value or the name, the cell fields it sets)."""
    choices = []  # per axis: (name or value, the cell fields it sets)
    for name, values in axes.items():
        aw = f"{where}: axes.{name}"
        if isinstance(values, list):
            _need(bool(values), aw, "must not be empty")
            _need(
                _is_field(name),
                aw,
                f"a list axis is named after the cell field it sets "
                f"({sorted(CELL_KEYS - {'id'})}, or a path such as overrides.lambda_mask)",
            )
            choices.append([(v, _nested(name, v)) for v in values])
        elif isinstance(values, dict):
            _need(bool(values), aw, "must not be empty")
            _need(not _is_field(name), aw, "a named axis (names -> cell fields) must not be called like a cell field")
            choices.append([(label, _partial(part, f"{aw}.{label}")) for label, part in values.items()])
        else:
            raise ExperimentError(
                f"{aw}: must be a list of values or a mapping of names to cell fields, got {values!r}"
            )
    return choices


def _exceptions(exceptions: Any, axes: dict[str, Any], where: str) -> list[dict[str, Any]]:
    """A grid's exceptions, checked: each a mapping {where, set} or {where, drop: true}."""
    _need(isinstance(exceptions, list), where, "exceptions must be a list of {where, set} or {where, drop: true}")
    for j, exc in enumerate(exceptions):
        ew = f"{where}: exceptions[{j}]"
        _need(isinstance(exc, dict), ew, "must be a mapping {where, set} or {where, drop: true}")
        unknown = sorted(set(map(str, exc)) - EXCEPTION_KEYS)
        _need(not unknown, ew, f"unknown key(s) {unknown}; allowed: {sorted(EXCEPTION_KEYS)}")
        cond = exc.get("where")
        _need(
            isinstance(cond, dict) and cond,
            ew,
            "needs where: a mapping of axis names or cell fields to the values they match",
        )
        for key in cond:
            _need(
                key == "id" or key in axes or _is_field(key), ew, f"where.{key} is neither an axis, a cell field nor id"
            )
        _need(exc.get("drop", True) is True, ew, f"drop must be true, got {exc.get('drop')!r}")
        _need(("set" in exc) != ("drop" in exc), ew, "needs either set: (cell fields) or drop: true")
        if "set" in exc:
            _partial(exc["set"], f"{ew}: set", allow_id=True)
    return exceptions


def _cell_entries(data: dict[str, Any], where: str) -> list[tuple[str, Any]]:
    """Every raw cell of an experiment file with where it comes from: ``cells`` and the expanded ``grids``,
    in the order the two keys have in the file."""
    raw_cells, grids = data.get("cells"), data.get("grids")
    if grids is None:
        _need(isinstance(raw_cells, list) and raw_cells, where, "cells must be a non-empty list")
    _need(raw_cells is None or isinstance(raw_cells, list), where, "cells must be a list")
    _need(grids is None or isinstance(grids, list) and grids, where, "grids must be a non-empty list of grids")
    entries: list[tuple[str, Any]] = []
    for key in data:
        if key == "cells":
            entries += [(f"{where}: cells[{i}]", raw) for i, raw in enumerate(raw_cells or [])]
        elif key == "grids":
            for g, grid in enumerate(grids):
                entries += expand_grid(grid, f"{where}: grids[{g}]")
    _need(bool(entries), where, "cells and grids hold no cell")
    return entries


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
    for cw, raw in _cell_entries(data, where):
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
    cid = str(raw.get("id") or f"{raw['model']}-{raw['dataset']}-p{p:g}-B{b}")
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
    if settings.victim_source == "federated" or cell.federation:  # a cell with its own federation: always
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
