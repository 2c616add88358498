"""Experiment grids: axes expanded as a cartesian product into raw cells, with exceptions, and the
raw cells of a whole experiment file (its ``cells`` and its expanded ``grids``, in file order)."""

from __future__ import annotations

import copy
import fnmatch
import itertools
import re
from typing import Any

from .cells import CELL_KEYS, ExperimentError
from .cells import need as _need

GRID_KEYS = {"id", "cell", "axes", "exceptions", "paper"}
EXCEPTION_KEYS = {"where", "set", "drop"}
DEFAULT_ID = "{model}-{dataset}-p{p}-B{victim_batch_size}"  # the id of a cell that names none, as a pattern
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


def format_id(pattern: str, cell: dict[str, Any], labels: dict[str, Any], where: str) -> str:
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
        cid = format_id(pattern, point, labels, where)
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


def cell_entries(data: dict[str, Any], where: str) -> list[tuple[str, Any]]:
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
