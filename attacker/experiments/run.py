"""Running an experiment: every selected cell as an ``attacker run`` into its own folder (a finished
cell is skipped, an interrupted one resumes), the federated victims when the cells take them from a
Flower simulation, and the federations behind Table 1's accuracy column."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from fedsim.atomic import atomic_write
from fedsim.capture_kinds import CAPTURE_KINDS
from fedsim.run_config import DEFAULTS, to_run_config

from ..config import RunConfig
from . import cluster
from .cluster import RayOptions
from .layout import accuracy_dir, cell_dir, run_state
from .report import write_report
from .spec import Cell, Experiment, ExperimentError, Settings, build_cell_config, select_cells


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
    return [
        f"{k.rstrip('.')}: {a.get(k)!r} -> {b.get(k)!r}"
        for k in sorted(set(a) | set(b))
        if k != "device." and a.get(k) != b.get(k)
    ]


def _run_federation(config: dict[str, Any]) -> Path:
    """Indirection so tests can stand in for the (slow) Ray simulation."""
    from fedsim.simulation import run_simulation_job

    return run_simulation_job(config, quiet=True)  # the experiment logs each cell; Flower's warnings stay


def capture_federation(
    cfg: RunConfig, settings: Settings, log: Callable[[str], Any], federation: dict[str, Any] | None = None
) -> Path:
    """The victims of a cell as the paper takes them, through the federated pipeline: one Flower
    round at the model's random initialization in which each of count/B clients takes one training
    step on B images of its own partition and the curious server captures the gradients.

    With ``federation`` (a cell's own run config settings, e.g. a defense): --fl-rounds training
    rounds under those settings, then one more round, captured: the cell's accuracy is the model's
    after the training rounds (results.json's history), its leakage that of the audited round. The
    audited round is kept apart so that its one-step update (onestep_lr) does not move the accuracy."""
    v = cfg.victims
    fed_dir = Path(v.captures or "")
    if (fed_dir / "results.json").is_file():
        return fed_dir
    if fed_dir.exists():
        shutil.rmtree(fed_dir)  # an interrupted federation: its round is redone from the start
    clients = v.count // v.victim_batch_size
    rounds = settings.fl_rounds + 1 if federation else 1
    if federation:
        own = to_run_config(federation)
        audited = (
            f"each client's local round on {own.get('capture-images', 'all its')} image(s) of its partition, its update"
            if CAPTURE_KINDS[own.get("capture-kind", DEFAULTS["capture-kind"])].replays_local_round
            else f"one step on {v.victim_batch_size} image(s) per client"
        )
        log(
            f"  federation: {rounds - 1} training rounds + 1 audited round, {own.get('num-clients', clients)} "
            f"clients, {federation}; round {rounds} captured ({audited})"
        )
    else:
        log(
            f"  federated victims: 1 Flower round, {clients} clients, each one step on {v.victim_batch_size} image(s), "
            "captured"
        )
    config = to_run_config(
        {
            "model": v.model,
            "dataset": v.dataset,
            "p": v.p,
            "model_options": v.model_options,
            "model_seed": v.model_seed,
            "num_clients": clients,
            "num_server_rounds": rounds,
            "capture_rounds": str(rounds),
            "victim_batch_size": v.victim_batch_size,
            "audit": True,
            "run_dir": str(fed_dir),
            "data_root": v.data_root,
            "seed": v.seed,
        }
    )
    config.update(to_run_config(federation or {}))
    return _run_federation(config)


def accuracy_jobs(selected: list[tuple[Experiment, Cell]]) -> dict[tuple[str, str, float], dict[str, Any]]:
    jobs: dict[tuple[str, str, float], dict[str, Any]] = {}
    for exp, cell in selected:
        if exp.accuracy is not None and "accuracy" in cell.paper and not cell.federation:  # those train their own
            jobs.setdefault((cell.model, cell.dataset, cell.p), dict(exp.accuracy.get("run_config") or {}))
    return jobs


def run_accuracy(
    out: Path, selected: list[tuple[Experiment, Cell]], settings: Settings, log: Callable[[str], Any]
) -> None:
    jobs = accuracy_jobs(selected)
    for n, ((model, dataset, p), base) in enumerate(sorted(jobs.items()), 1):
        run_dir = accuracy_dir(out, model, dataset, p, settings)
        if (run_dir / "results.json").is_file():
            log(f"[dim]accuracy {n}/{len(jobs)} {model}/{dataset} p={p:g}: finished, skipped[/dim]")
            continue
        if run_dir.exists():  # an interrupted simulation: Flower cannot resume it, start it again
            shutil.rmtree(run_dir)
        config = dict(
            base,
            model=model,
            dataset=dataset,
            p=p,
            **{
                "num-server-rounds": settings.fl_rounds,
                "run-dir": str(run_dir),
                "data-root": settings.data_root,
                "seed": settings.seed,
            },
        )
        if settings.fl_local_steps:
            config["local-steps"] = settings.fl_local_steps
        if settings.fl_clients:
            config["num-clients"] = settings.fl_clients
        log(
            f"[bold]accuracy {n}/{len(jobs)}[/bold] {model}/{dataset} p={p:g}: federated training, "
            f"{settings.fl_rounds} rounds (paper: to convergence)"
        )
        t0 = time.time()
        try:
            _run_federation(config)
        except Exception as err:  # noqa: BLE001 - a failed federation must not cost the attack results
            log(f"[red]accuracy {model}/{dataset} p={p:g} failed:[/red] {err}")
            atomic_write(run_dir / "failed.txt", f"{type(err).__name__}: {err}\n")
            continue
        log(f"  done in {time.time() - t0:.0f} s")


def _run_sequential(
    experiments: list[Experiment],
    selected: list[tuple[Experiment, Cell]],
    configs: dict[str, RunConfig],
    out: Path,
    settings: Settings,
    log: Callable[[str], Any],
) -> dict[str, int]:
    """The cells one after another in this process."""
    from ..pipeline import run_attack

    counts = {"ran": 0, "skipped": 0, "failed": 0}
    started = time.time()
    for n, (_, cell) in enumerate(selected, 1):
        run_dir = cell_dir(out, cell)
        head = f"[{n}/{len(selected)}] {cell.key}"
        if run_state(run_dir) == "finished":
            counts["skipped"] += 1
            log(f"[dim]{head}: finished, skipped[/dim]")
            continue
        elapsed = time.time() - started
        ran = counts["ran"]
        eta = f", about {elapsed / ran * (len(selected) - n + 1) / 60:.0f} min left" if ran else ""
        resume = " (resuming)" if run_dir.exists() else ""
        log(f"[bold cyan]{head}[/bold cyan]{resume}: {cell.label(settings.iterations)}, {', '.join(cell.attacks)}{eta}")
        (run_dir / "failed.txt").unlink(missing_ok=True)
        try:
            if cell.federated(settings):
                capture_federation(configs[cell.key], settings, log, cell.federation)
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
    return counts


def _run_on_ray(
    experiments: list[Experiment],
    selected: list[tuple[Experiment, Cell]],
    configs: dict[str, RunConfig],
    out: Path,
    settings: Settings,
    ray: RayOptions,
    log: Callable[[str], Any],
) -> dict[str, int]:
    """The unfinished cells as Ray tasks. Federated victims are captured first, here on the driver:
    Flower's simulation starts and stops a Ray of its own, so it cannot run beside ours or in a task."""
    todo = []
    skipped = 0
    for _, cell in selected:
        run_dir = cell_dir(out, cell)
        if run_state(run_dir) == "finished":
            skipped += 1
            log(f"[dim]{cell.key}: finished, skipped[/dim]")
            continue
        todo.append((cell, configs[cell.key], run_dir))
    if not todo:
        return {"skipped": skipped}
    for cell, cfg, _ in todo:
        if cell.federated(settings):
            log(f"[bold]{cell.key}[/bold]: capturing the federated victims")
            capture_federation(cfg, settings, log, cell.federation)
    cluster.connect(ray)
    try:
        described = cluster.check_resources(ray)
        log(f"{len(todo)} cell(s) on {ray.where} ({described}): {ray.request}")
        counts = cluster.run_cells(todo, ray, log, lambda: write_report(experiments, selected, out, settings))
    except BaseException:
        write_report(experiments, selected, out, settings)  # whatever finished is in the report
        raise
    finally:
        cluster.disconnect()
    return {**counts, "skipped": skipped}


def run_experiments(
    experiments: list[Experiment],
    out: str | Path,
    settings: Settings,
    log: Callable[[str], Any] = print,
    ray: RayOptions | None = None,
) -> dict[str, Any]:
    """Run (or skip) every selected cell, then write the report. Returns counts and the report path.
    With ``ray``, the unfinished cells run as Ray tasks (:mod:`.cluster`), the report grows as they finish."""
    out = Path(out)
    if any(c.federated(settings) for e in experiments for c in e.cells):
        settings = replace(settings, federation_dir=str(out / "federations"))
    selected = select_cells(experiments, settings)
    if not selected:
        raise ExperimentError(
            "no cell matches --cells " + " ".join(settings.cells)
            if settings.cells
            else "the experiments hold no cell to run (optional cells need --include-optional)"
        )
    configs = {cell.key: build_cell_config(exp, cell, settings) for exp, cell in selected}  # validate all first
    for _, cell in selected:
        run_dir = cell_dir(out, cell)
        if run_dir.exists():
            diff = _config_diff(run_dir, configs[cell.key])
            if diff:
                raise ExperimentError(
                    f"{run_dir} holds a run with other settings ({'; '.join(diff[:3])}); use another --out or "
                    f"remove that folder"
                )
    if ray is not None:
        ray.check()
        if settings.device not in ("auto", "cpu") and ray.gpus_per_task == 0:
            raise cluster.ClusterError(
                f"--device {settings.device} on Ray needs a GPU per task: set --ray-gpus-per-task "
                f"(e.g. 0.25 to share one GPU among four cells)"
            )
        cluster.check_address(ray)  # an address nothing listens at fails before any work
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    counts = {"ran": 0, "skipped": 0, "failed": 0}
    if ray is None:
        counts.update(_run_sequential(experiments, selected, configs, out, settings, log))
    else:
        counts.update(_run_on_ray(experiments, selected, configs, out, settings, ray, log))
    if settings.accuracy:
        run_accuracy(out, selected, settings, log)
    report = write_report(experiments, selected, out, settings)
    return {**counts, "cells": len(selected), "report": str(report), "seconds": time.time() - started}
