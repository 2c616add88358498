"""The paper's experiments as config files: cells of attack runs, resumable, reported beside the paper.

An experiment file (``configs/experiments/*.yaml``) holds defaults and a list of *cells*; each cell is one
``attacker run`` (model, dataset, p, B, attacks, attack overrides) plus the paper's value for every
metric the paper reports for it. ``run_experiments`` runs every selected cell into
``OUT/cells/<experiment>-<cell>`` (a finished cell is skipped, an interrupted one resumes from its
checkpoint), optionally trains the federation for Table 1's accuracy column, and writes
``OUT/results.md``, ``OUT/results.csv`` and ``OUT/figures/*.png``.
"""

from __future__ import annotations

import fnmatch
import io
import json
import math
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import yaml

from .config import ConfigError, RunConfig, parse_config
from .report import atomic_write, csv_text

PAPER_VICTIMS = {
    "mnist": "../shared/data/dia-victims/MNIST_128.tdump",
    "cifar10": "../shared/data/dia-victims/CIFAR10_128.tdump",
}
REPO_ROOT = Path(__file__).resolve().parents[1]
EXPERIMENT_KEYS = {"name", "title", "source", "victims", "attack_overrides", "metrics", "accuracy", "figures", "cells"}
CELL_KEYS = {"id", "model", "dataset", "p", "B", "attacks", "overrides", "model_options", "victims", "optional", "paper"}
METRICS = {"ssim", "mmd"}  # the paper's per-cell metrics we compare; ssim in the paper's space
FIGURE_KEYS = {"name", "metric", "x", "series", "panel", "attack"}
CELL_FIELDS = ("model", "dataset", "p", "B", "lambda_mask", "mask_init", "attack")
SUMMARY_METRICS = ("ssim_paper", "ssim_std", "psnr_paper", "lpips", "mmd", "trd", "iterations")


class ExperimentError(ConfigError):
    """An experiment file or an output folder the user must fix."""


@dataclass
class Cell:
    experiment: str
    id: str
    model: str
    dataset: str
    p: float
    B: int
    attacks: list[str]
    overrides: dict[str, Any] = field(default_factory=dict)
    model_options: dict[str, Any] = field(default_factory=dict)
    victims: dict[str, Any] = field(default_factory=dict)
    optional: bool = False
    paper: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.experiment}-{self.id}"

    def label(self) -> str:
        extra = "".join(f", {k}={v}" for k, v in self.overrides.items())
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


# ----------------------------------------------------------------------------------------------- loading


def _need(cond: bool, where: str, msg: str) -> None:
    if not cond:
        raise ExperimentError(f"{where}: {msg}")


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
        _need(isinstance(fig, dict) and {"name", "metric", "x", "series"} <= set(fig) and set(fig) <= FIGURE_KEYS,
              where, f"each figure needs name, metric, x, series (optional panel, attack); got {fig}")
    accuracy = data.get("accuracy")
    _need(accuracy is None or isinstance(accuracy, dict), where, "accuracy must be a mapping")
    raw_cells = data.get("cells")
    _need(isinstance(raw_cells, list) and raw_cells, where, "cells must be a non-empty list")
    cells, seen = [], set()
    for i, raw in enumerate(raw_cells):
        cw = f"{where}: cells[{i}]"
        _need(isinstance(raw, dict), cw, "must be a mapping")
        unknown = sorted(set(raw) - CELL_KEYS)
        _need(not unknown, cw, f"unknown key(s) {unknown}; allowed: {sorted(CELL_KEYS)}")
        for key in ("model", "dataset", "p", "attacks"):
            _need(key in raw, cw, f"missing {key}")
        p = raw["p"]
        _need(isinstance(p, (int, float)) and not isinstance(p, bool), cw, f"p must be a number, got {p!r}")
        b = raw.get("B", 1)
        _need(isinstance(b, int) and not isinstance(b, bool) and b > 0, cw, f"B must be a positive integer, got {b!r}")
        attacks = raw["attacks"]
        _need(isinstance(attacks, list) and attacks and all(isinstance(a, str) for a in attacks), cw,
              "attacks must be a non-empty list of attack names")
        cid = str(raw.get("id") or f"{raw['model']}-{raw['dataset']}-p{p:g}-B{b}")
        _need(all(c.isalnum() or c in "-_.+" for c in cid), cw, f"id {cid!r} may hold only letters, digits and -_.+")
        _need(cid not in seen, cw, f"duplicate id {cid!r}")
        seen.add(cid)
        paper = raw.get("paper") or {}
        _need(isinstance(paper, dict), cw, "paper must be a mapping")
        for key, value in paper.items():
            if key == "accuracy":
                _need(value is None or isinstance(value, (int, float)), cw, "paper.accuracy must be a number or null")
                continue
            _need(isinstance(value, dict) and set(value) <= METRICS, cw,
                  f"paper.{key} must map metrics {sorted(METRICS)} to values (null when unknown)")
        for key in ("overrides", "model_options", "victims"):
            _need(isinstance(raw.get(key) or {}, dict), cw, f"{key} must be a mapping")
        cells.append(Cell(name, cid, str(raw["model"]), str(raw["dataset"]), float(p), int(b), list(attacks),
                          dict(raw.get("overrides") or {}), dict(raw.get("model_options") or {}),
                          dict(raw.get("victims") or {}), bool(raw.get("optional", False)), dict(paper)))
    return Experiment(name, str(data.get("title") or name), str(data.get("source") or ""), dict(data.get("victims") or {}),
                      dict(data.get("attack_overrides") or {}), metrics, accuracy, figures, cells, path)


def _resolve_victim_file(dataset: str) -> Path | None:
    rel = PAPER_VICTIMS.get(dataset)
    if rel is None:
        return None
    for base in (Path.cwd(), REPO_ROOT):
        candidate = base / rel
        if candidate.is_file():
            return candidate
    return None


def cell_config(exp: Experiment, cell: Cell, settings: Settings) -> dict[str, Any]:
    """The ``attacker run`` config mapping of one cell under the command line's settings."""
    victims: dict[str, Any] = {"source": "builtin", "count": 128, "data_root": settings.data_root}
    victims.update(exp.victims)
    victims.update(cell.victims)
    if settings.victim_source == "paper" and "source" not in cell.victims:
        path = _resolve_victim_file(cell.dataset)
        if cell.dataset in PAPER_VICTIMS:
            if path is None:
                raise ExperimentError(
                    f"cell {cell.key}: the paper's {cell.dataset} victims ({PAPER_VICTIMS[cell.dataset]}, relative to the "
                    f"repository root) are not there; use --victim-source builtin")
            victims["source"], victims["file"] = "file", str(path)
    elif settings.victim_source == "builtin":
        victims["source"] = "builtin"
        victims.pop("file", None)
    elif settings.victim_source == "federated":
        victims["source"], victims["captures"] = "captures", str(Path(settings.federation_dir) / cell.key)
        victims.pop("file", None)
    count = settings.victims if settings.victims is not None else int(victims.get("count", 128))
    victims["count"] = max(cell.B, math.ceil(count / cell.B) * cell.B)
    victims.update(model=cell.model, dataset=cell.dataset, p=cell.p, batch_size=cell.B,
                   model_options=dict(cell.model_options))
    overrides = dict(exp.attack_overrides)
    overrides.update(cell.overrides)
    if settings.iterations is not None:
        overrides["max_iterations"] = settings.iterations
    return {"victims": victims, "attacks": list(cell.attacks), "attack_overrides": overrides,
            "device": settings.device, "lpips": settings.lpips, "seed": settings.seed}


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


# ----------------------------------------------------------------------------------------------- running


def _run_state(run_dir: Path) -> str:
    try:
        return json.loads((run_dir / "run.json").read_text()).get("status", "unknown")
    except (OSError, ValueError):
        return "missing"


def _config_diff(run_dir: Path, cfg: RunConfig) -> list[str]:
    """Settings that differ between the run already in ``run_dir`` and ``cfg`` (device aside)."""
    try:
        old = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return []
    new = yaml.safe_load(yaml.safe_dump(cfg.to_dict()))

    def flat(d: Any, prefix: str = "") -> dict[str, Any]:
        if not isinstance(d, dict):
            return {prefix: d}
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}."))
        return out

    a, b = flat(old), flat(new)
    return [f"{k.rstrip('.')}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b))
            if k != "device." and a.get(k) != b.get(k)]


def _run_federation(config: dict[str, Any]) -> Path:
    """Indirection so tests can stand in for the (slow) Ray simulation."""
    from fedsim.simulation import run_simulation_job

    return run_simulation_job(config)


def capture_federation(cfg: RunConfig, settings: Settings, log: Callable[[str], Any]) -> Path:
    """The victims of a cell as the paper takes them, through the federated pipeline: one Flower
    round at the model's random initialization in which each of count/B clients takes one training
    step on B images of its own partition and the curious server captures the gradients."""
    v = cfg.victims
    fed_dir = Path(v.captures or "")
    if (fed_dir / "results.json").is_file():
        return fed_dir
    if fed_dir.exists():
        shutil.rmtree(fed_dir)  # an interrupted federation: its round is redone from the start
    clients = v.count // v.batch_size
    log(f"  federated victims: 1 Flower round, {clients} clients, each one step on {v.batch_size} image(s), captured")
    return _run_federation({
        "model": v.model, "dataset": v.dataset, "p": v.p, "model-options": json.dumps(v.model_options),
        "model-seed": v.model_seed, "num-clients": clients, "num-server-rounds": 1, "capture-rounds": "1",
        "victim-batch-size": v.batch_size, "audit": True, "run-dir": str(fed_dir), "data-root": v.data_root,
        "seed": v.seed,
    })


def accuracy_jobs(selected: list[tuple[Experiment, Cell]]) -> dict[tuple[str, str, float], dict[str, Any]]:
    jobs: dict[tuple[str, str, float], dict[str, Any]] = {}
    for exp, cell in selected:
        if exp.accuracy is not None and "accuracy" in cell.paper:
            jobs.setdefault((cell.model, cell.dataset, cell.p), dict(exp.accuracy.get("run_config") or {}))
    return jobs


def accuracy_dir(out: Path, model: str, dataset: str, p: float, settings: Settings) -> Path:
    """One folder per federation setting, so a changed --fl-* option never reuses a stale result."""
    tag = f"r{settings.fl_rounds}" + (f"-c{settings.fl_clients}" if settings.fl_clients else "") + (
        f"-s{settings.fl_local_steps}" if settings.fl_local_steps else "")
    return out / "accuracy" / f"{model}-{dataset}-p{p:g}-{tag}"


def run_accuracy(out: Path, selected: list[tuple[Experiment, Cell]], settings: Settings,
                 log: Callable[[str], Any]) -> None:
    jobs = accuracy_jobs(selected)
    for n, ((model, dataset, p), base) in enumerate(sorted(jobs.items()), 1):
        run_dir = accuracy_dir(out, model, dataset, p, settings)
        if (run_dir / "results.json").is_file():
            log(f"[dim]accuracy {n}/{len(jobs)} {model}/{dataset} p={p:g}: finished, skipped[/dim]")
            continue
        if run_dir.exists():  # an interrupted simulation: Flower cannot resume it, start it again
            shutil.rmtree(run_dir)
        config = dict(base, model=model, dataset=dataset, p=p, **{"num-server-rounds": settings.fl_rounds,
                      "run-dir": str(run_dir), "data-root": settings.data_root, "seed": settings.seed})
        if settings.fl_local_steps:
            config["local-steps"] = settings.fl_local_steps
        if settings.fl_clients:
            config["num-clients"] = settings.fl_clients
        log(f"[bold]accuracy {n}/{len(jobs)}[/bold] {model}/{dataset} p={p:g}: federated training, "
            f"{settings.fl_rounds} rounds (paper: to convergence)")
        t0 = time.time()
        try:
            _run_federation(config)
        except Exception as err:  # noqa: BLE001 - a failed federation must not cost the attack results
            log(f"[red]accuracy {model}/{dataset} p={p:g} failed:[/red] {err}")
            atomic_write(run_dir / "failed.txt", f"{type(err).__name__}: {err}\n")
            continue
        log(f"  done in {time.time() - t0:.0f} s")


def run_experiments(
    experiments: list[Experiment],
    out: str | Path,
    settings: Settings,
    log: Callable[[str], Any] = print,
) -> dict[str, Any]:
    """Run (or skip) every selected cell, then write the report. Returns counts and the report path."""
    from .pipeline import run_attack

    out = Path(out)
    if settings.victim_source == "federated":
        settings = replace(settings, federation_dir=str(out / "federations"))
    selected = select_cells(experiments, settings)
    if not selected:
        raise ExperimentError("no cell matches --cells " + " ".join(settings.cells) if settings.cells else
                              "the experiments hold no cell to run (optional cells need --include-optional)")
    configs = {cell.key: build_cell_config(exp, cell, settings) for exp, cell in selected}  # validate all first
    for _, cell in selected:
        run_dir = out / "cells" / cell.key
        if run_dir.exists():
            diff = _config_diff(run_dir, configs[cell.key])
            if diff:
                raise ExperimentError(
                    f"{run_dir} holds a run with other settings ({'; '.join(diff[:3])}); use another --out or "
                    f"remove that folder")
    out.mkdir(parents=True, exist_ok=True)
    counts = {"ran": 0, "skipped": 0, "failed": 0}
    started = time.time()
    for n, (_, cell) in enumerate(selected, 1):
        run_dir = out / "cells" / cell.key
        head = f"[{n}/{len(selected)}] {cell.key}"
        if _run_state(run_dir) == "finished":
            counts["skipped"] += 1
            log(f"[dim]{head}: finished, skipped[/dim]")
            continue
        elapsed = time.time() - started
        ran = counts["ran"]
        eta = f", about {elapsed / ran * (len(selected) - n + 1) / 60:.0f} min left" if ran else ""
        resume = " (resuming)" if run_dir.exists() else ""
        log(f"[bold cyan]{head}[/bold cyan]{resume}: {cell.label()}, {', '.join(cell.attacks)}{eta}")
        (run_dir / "failed.txt").unlink(missing_ok=True)
        try:
            if settings.victim_source == "federated":
                capture_federation(configs[cell.key], settings, log)
            run_attack(configs[cell.key], run_dir, progress=settings.progress, log=lambda m: log(f"  {m}"))
        except KeyboardInterrupt:
            write_report(experiments, selected, out, settings)
            raise
        except Exception as err:  # one failed cell must not cost the others
            counts["failed"] += 1
            atomic_write(run_dir / "failed.txt", f"{type(err).__name__}: {err}\n")
            log(f"[red]{head} failed:[/red] {type(err).__name__}: {err}")
            continue
        counts["ran"] += 1
        write_report(experiments, selected, out, settings)  # the report grows cell by cell
    if settings.accuracy:
        run_accuracy(out, selected, settings, log)
    report = write_report(experiments, selected, out, settings)
    return {**counts, "cells": len(selected), "report": str(report), "seconds": time.time() - started}


# ----------------------------------------------------------------------------------------------- reporting


def _fmt(mean: float | None, std: float | None = None, digits: int = 3) -> str:
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return "–"
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if std is not None else f"{mean:.{digits}f}"


def _paper(value: Any, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _accuracy(out: Path, cell: Cell, settings: Settings) -> dict[str, Any] | None:
    run_dir = accuracy_dir(out, cell.model, cell.dataset, cell.p, settings)
    res = _load_json(run_dir / "results.json")
    if res is None:
        return None
    return {"final": 100 * float(res["final_accuracy"]), "best": 100 * float(res["best_accuracy"]),
            "rounds": int(res.get("rounds_run", settings.fl_rounds))}


def collect_rows(experiments: list[Experiment], selected: list[tuple[Experiment, Cell]], out: Path,
                 settings: Settings) -> list[dict[str, Any]]:
    """One row per (cell, attack) of every experiment: ours (when run) beside the paper's values."""
    chosen = {cell.key for _, cell in selected}
    rows = []
    for exp in experiments:
        for cell in exp.cells:
            run_dir = out / "cells" / cell.key
            state = _run_state(run_dir) if run_dir.exists() else ("not selected" if cell.key not in chosen else "not run")
            if (run_dir / "failed.txt").is_file() and state != "finished":
                state = "failed"
            summary = {e["attack"]: e for e in (_load_json(run_dir / "summary.json") or [])} if state == "finished" else {}
            metrics = _load_json(run_dir / "metrics.json") or [] if state == "finished" else []
            acc = _accuracy(out, cell, settings) if exp.accuracy is not None and "accuracy" in cell.paper else None
            for attack in cell.attacks:
                e = summary.get(attack, {})
                row: dict[str, Any] = {
                    "experiment": exp.name, "cell": cell.id, "model": cell.model, "dataset": cell.dataset,
                    "p": cell.p, "B": cell.B, "attack": attack,
                    "lambda_mask": cell.overrides.get("lambda_mask", exp.attack_overrides.get("lambda_mask")),
                    "mask_init": cell.overrides.get("mask_init", exp.attack_overrides.get("mask_init")),
                    "overrides": json.dumps({**exp.attack_overrides, **cell.overrides}, sort_keys=True),
                    "status": state, "victims": e.get("victims"),
                }
                for key in SUMMARY_METRICS:
                    row[f"{key}_mean"] = e.get(f"{key}_mean")
                    row[f"{key}_std"] = e.get(f"{key}_std")
                unmatched = [float(m["ssim_paper_unmatched"]) for m in metrics
                             if m.get("attack") == attack and m.get("ssim_paper_unmatched") is not None]
                row["ssim_paper_unmatched_mean"] = sum(unmatched) / len(unmatched) if unmatched else None
                paper = cell.paper.get(attack) or {}
                row["paper_ssim"] = paper.get("ssim")
                row["paper_mmd"] = paper.get("mmd")
                if exp.accuracy is not None:
                    row["paper_accuracy"] = cell.paper.get("accuracy")
                    row["accuracy_final"] = acc["final"] if acc else None
                    row["accuracy_best"] = acc["best"] if acc else None
                    row["fl_rounds"] = acc["rounds"] if acc else None
                rows.append(row)
    return rows


def _figure(exp: Experiment, fig: dict[str, Any], rows: list[dict[str, Any]], path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric = fig["metric"]
    paper_key = {"ssim_paper": "paper_ssim", "mmd": "paper_mmd"}.get(metric)
    rows = [r for r in rows if r["experiment"] == exp.name and (fig.get("attack") in (None, r["attack"]))]
    if metric == "mmd":
        rows = [r for r in rows if r["attack"] in ("dia", "dia_april")]
    panel_keys = list(fig.get("panel") or [])
    panels = sorted({tuple(r[k] for k in panel_keys) for r in rows})
    if not rows or not panels:
        return False
    fig_, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    x_key, s_key = fig["x"], fig["series"]
    for ax, panel in zip(axes[0], panels):
        prow = [r for r in rows if tuple(r[k] for k in panel_keys) == panel]
        for i, series in enumerate(sorted({r[s_key] for r in prow}, key=lambda v: (v is None, str(v) if not isinstance(v, (int, float)) else v))):
            srow = sorted((r for r in prow if r[s_key] == series), key=lambda r: r[x_key])
            color = f"C{i}"
            ours = [(r[x_key], r[f"{metric}_mean"], r[f"{metric}_std"]) for r in srow if r.get(f"{metric}_mean") is not None]
            if ours:
                xs, ys, es = zip(*ours)
                ax.errorbar(xs, ys, yerr=es, color=color, marker="o", capsize=3, label=f"{s_key}={series} (ours)")
            if paper_key:
                theirs = [(r[x_key], r[paper_key]) for r in srow if r.get(paper_key) is not None]
                if theirs:
                    xs, ys = zip(*theirs)
                    ax.plot(xs, ys, color=color, marker="x", ls="--", alpha=0.7, label=f"{s_key}={series} (paper)")
        if x_key == "B":
            ax.set_xscale("log", base=2)
            ax.set_xticks([1, 4, 8, 16])
            ax.set_xticklabels(["1", "4", "8", "16"])
        ax.set_xlabel(x_key)
        ax.set_ylabel({"ssim_paper": "SSIM (paper space)", "mmd": "MMD"}.get(metric, metric))
        ax.set_title(" / ".join(str(v) for v in panel), fontsize=9)
        ax.grid(alpha=0.3)
        if metric == "ssim_paper":
            ax.set_ylim(-0.05, 1.05)
    axes[0][-1].legend(fontsize=6, loc="best")
    fig_.suptitle(f"{exp.title}: {fig['name']}", fontsize=9)
    fig_.tight_layout()
    buf = io.BytesIO()
    fig_.savefig(buf, format="png", dpi=110)
    plt.close(fig_)
    atomic_write(path, buf.getvalue())
    return True


def write_report(experiments: list[Experiment], selected: list[tuple[Experiment, Cell]], out: str | Path,
                 settings: Settings) -> Path:
    out = Path(out)
    rows = collect_rows(experiments, selected, out, settings)
    atomic_write(out / "results.csv", csv_text(rows))
    iters = f"{settings.iterations:,}" if settings.iterations else "the configs' (paper: 20,000)"
    lines = [
        "# Reproduction of \"Dropout is NOT All You Need to Prevent Gradient Leakage\"\n",
        f"Victims: {settings.victim_source} ({settings.victims or 'the configs’'} images per cell); iteration cap: "
        f"{iters}; device: {settings.device}. Updated {time.strftime('%Y-%m-%d %H:%M:%S')}.\n",
        "**SSIM spaces.** *SSIM (paper space)* is computed on normalized tensors with data_range = 1/std — the space "
        "the paper's numbers live in, so compare it with the *paper* column. *SSIM [0,1]* is the standard space "
        "(images mapped back to [0,1], data_range 1); it runs lower. For B > 1 reconstructions are matched to "
        "originals (Hungarian assignment); `results.csv` also holds the unmatched SSIM. Values are mean ± std over "
        "victim jobs (the *victims* column: jobs × B; a job's value is the mean over its B images); the paper used 128 victims (Table 4: 10) and up to 20,000 iterations.\n",
    ]
    for exp in experiments:
        erows = [r for r in rows if r["experiment"] == exp.name]
        lines.append(f"\n## {exp.title}\n")
        if exp.source:
            lines.append(f"Paper values: {exp.source}.\n")
        has_mmd = "mmd" in exp.metrics
        has_acc = exp.accuracy is not None
        head = ["cell", "model", "data", "p", "B"]
        if any(r["lambda_mask"] is not None for r in erows):
            head.append("λ_mask")
        if any(r["mask_init"] is not None for r in erows):
            head.append("mask init")
        head += ["attack", "victims", "SSIM paper-space (ours)", "SSIM paper", "SSIM [0,1] (ours)"]
        if has_mmd:
            head += ["MMD (ours)", "MMD paper"]
        if has_acc:
            head += ["acc % final/best (ours)", "acc % paper"]
        head.append("status")
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for r in erows:
            cells = [r["cell"], r["model"], r["dataset"], f"{r['p']:g}", str(r["B"])]
            if "λ_mask" in head:
                cells.append("–" if r["lambda_mask"] is None else f"{r['lambda_mask']:g}")
            if "mask init" in head:
                cells.append(r["mask_init"] or "–")
            victims = "–" if not r["victims"] else (f"{r['victims']}×{r['B']}" if r["B"] > 1 else str(r["victims"]))
            cells += [r["attack"], victims, _fmt(r["ssim_paper_mean"], r["ssim_paper_std"]),
                      _paper(r["paper_ssim"]), _fmt(r["ssim_std_mean"], r["ssim_std_std"])]
            if has_mmd:
                cells += [_fmt(r["mmd_mean"], r["mmd_std"]), _paper(r["paper_mmd"])]
            if has_acc:
                acc = "–" if r.get("accuracy_final") is None else f"{r['accuracy_final']:.2f} / {r['accuracy_best']:.2f} ({r['fl_rounds']} rounds)"
                cells += [acc, _paper(r.get("paper_accuracy"))]
            cells.append(r["status"])
            lines.append("| " + " | ".join(cells) + " |")
        if has_acc:
            paper_rounds = exp.accuracy.get("paper_rounds") if exp.accuracy else None
            lines.append(f"\nAccuracy: global test accuracy after {settings.fl_rounds} federated rounds "
                         f"({'run' if settings.accuracy else 'skipped: --no-accuracy'}; the paper trains to convergence, "
                         f"up to {paper_rounds} rounds), from `accuracy/`.\n")
        for fig in exp.figures:
            path = out / "figures" / f"{exp.name}_{fig['name']}.png"
            if _figure(exp, fig, rows, path):
                lines.append(f"\n![{exp.name} {fig['name']}](figures/{path.name})\n")
        shown = [c for c in exp.cells if _run_state(out / "cells" / c.key) == "finished"]
        if shown:
            lines.append("\n<details><summary>Reconstructions and loss curves per cell</summary>\n")
            for c in shown:
                lines.append(f"\n**{c.key}** ({c.label()}) — [report](cells/{c.key}/report.md)\n\n"
                             f"![grid](cells/{c.key}/grid.png) ![loss](cells/{c.key}/loss_curves.png)\n")
            lines.append("\n</details>\n")
    path = out / "results.md"
    atomic_write(path, "\n".join(lines) + "\n")
    return path
