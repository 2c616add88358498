"""An experiment's report: ``OUT/results.csv`` (one row per cell and attack, ours beside the paper's
values), ``OUT/results.md`` and ``OUT/figures/*.png``, read from the cells' run folders. Shared
pieces (CSV text, PNG bytes, mean ± std, the per-run summary keys) come from :mod:`attacker.report`."""

from __future__ import annotations

import csv
import json
import time
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from fedsim.atomic import atomic_write

from ..attacks import CLOSED_FORM_GROUP, CLOSED_FORMS
from ..report import SUMMARY_KEYS, csv_text, figure_png, fmt_mean_std
from .frontier import defense_fields, epsilon_text, frontier_figure, level_text
from .layout import accuracy_dir, cell_dir, run_state
from .spec import Cell, Experiment, Settings

# The per-attack summary values each results row carries (mse_paper stays in each cell's own summary).
SUMMARY_METRICS = tuple(key for key in SUMMARY_KEYS if key != "mse_paper")


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _accuracy(out: Path, cell: Cell, settings: Settings) -> dict[str, Any] | None:
    # a cell with its own federation (a defense, ...): that federation's accuracy (run.capture_federation)
    run_dir = (
        out / "federations" / cell.key
        if cell.federation
        else accuracy_dir(out, cell.model, cell.dataset, cell.p, settings)
    )
    res = _load_json(run_dir / "results.json")
    if res is None:
        return None
    if cell.federation:  # the model after the training rounds; the last, audited round is not training
        trained = [r for r in res.get("rounds", []) if 0 < int(r["round"]) <= settings.fl_rounds]
        if not trained:
            return None
        return {
            "final": 100 * float(trained[-1]["accuracy"]),
            "best": 100 * max(float(r["accuracy"]) for r in trained),
            "rounds": len(trained),
        }
    return {
        "final": 100 * float(res["final_accuracy"]),
        "best": 100 * float(res["best_accuracy"]),
        "rounds": int(res.get("rounds_run", settings.fl_rounds)),
    }


def time_to_paper(run_dir: Path, attack: str, metrics: list[dict], target: float | None) -> tuple[Any, Any]:
    """(iterations, seconds) until the attack's mean SSIM curve (paper space) reached the paper's value.
    Seconds: the attack's share of the cell's wall time (its share of the victim-iterations), per
    iteration of its jobs, times that iteration."""
    if target is None or not (run_dir / "ssim_curves.csv").is_file():
        return None, None
    from ..curves import time_to  # attacker.curves imports Lightning: not at the CLI's import

    points: dict[str, list[tuple[int, float]]] = {}
    with open(run_dir / "ssim_curves.csv", newline="") as f:
        for r in csv.DictReader(f):
            if r["attack"] == attack:
                points.setdefault(r["job"], []).append((int(r["iteration"]), float(r["ssim_paper"])))
    iterations = [int(m["iterations"]) for m in metrics if m.get("attack") == attack]
    total = sum(int(m["iterations"]) for m in metrics)
    seconds = (_load_json(run_dir / "run.json") or {}).get("seconds")
    per_iteration = (
        seconds * sum(iterations) / total / (sum(iterations) / len(iterations)) if seconds and total else None
    )
    return time_to(list(points.values()), target, per_iteration)


def _cell_attacks(names: list[str], summary: dict[str, Any]) -> list[str]:
    """The attacks a cell's rows show: ``closed_form`` as the solvers it ran (one row each) once the
    cell has results, as itself before."""
    if CLOSED_FORM_GROUP not in names or not summary:
        return list(names)
    ran = [a for a in CLOSED_FORMS if a in summary and a not in names]
    return [x for a in names for x in (ran if a == CLOSED_FORM_GROUP else [a])]


def collect_rows(
    experiments: list[Experiment], selected: list[tuple[Experiment, Cell]], out: Path, settings: Settings
) -> list[dict[str, Any]]:
    """One row per (cell, attack) of every experiment: ours (when run) beside the paper's values."""
    chosen = {cell.key for _, cell in selected}
    rows = []
    for exp in experiments:
        for cell in exp.cells:
            run_dir = cell_dir(out, cell)
            state = (
                run_state(run_dir) if run_dir.exists() else ("not selected" if cell.key not in chosen else "not run")
            )
            if (run_dir / "failed.txt").is_file() and state != "finished":
                state = "failed"
            summary = (
                {e["attack"]: e for e in (_load_json(run_dir / "summary.json") or [])} if state == "finished" else {}
            )
            metrics = _load_json(run_dir / "metrics.json") or [] if state == "finished" else []
            # attacks the cell's captures cannot take (skip_inapplicable): their reasons are in closed_form.json
            skipped = (_load_json(run_dir / "closed_form.json") or {}).get("skipped", {}) if state == "finished" else {}
            acc = _accuracy(out, cell, settings) if exp.accuracy is not None and "accuracy" in cell.paper else None
            defense = defense_fields(out, cell)
            for attack in _cell_attacks(cell.attacks, summary):
                e = summary.get(attack, {})
                row: dict[str, Any] = {
                    "experiment": exp.name,
                    "cell": cell.id,
                    "model": cell.model,
                    "dataset": cell.dataset,
                    "p": cell.p,
                    "B": cell.B,
                    "attack": attack,
                    "K": cell.local_steps,
                    "optimizer": cell.optimizer,
                    "local_round": cell.local_round_label(),
                    "lambda_mask": cell.overrides.get("lambda_mask", exp.attack_overrides.get("lambda_mask")),
                    "mask_init": cell.overrides.get("mask_init", exp.attack_overrides.get("mask_init")),
                    "overrides": json.dumps({**exp.attack_overrides, **cell.overrides}, sort_keys=True),
                    "status": "skipped" if attack in skipped and attack not in summary else state,
                    "victims": e.get("victims"),
                    **defense,
                }
                for key in SUMMARY_METRICS:
                    row[f"{key}_mean"] = e.get(f"{key}_mean")
                    row[f"{key}_std"] = e.get(f"{key}_std")
                unmatched = [
                    float(m["ssim_paper_unmatched"])
                    for m in metrics
                    if m.get("attack") == attack and m.get("ssim_paper_unmatched") is not None
                ]
                row["ssim_paper_unmatched_mean"] = sum(unmatched) / len(unmatched) if unmatched else None
                row["reached_ssim90"] = e.get("reached_ssim90")
                paper = cell.paper.get(attack) or {}
                row["paper_ssim"] = paper.get("ssim")
                row["paper_mmd"] = paper.get("mmd")
                row["iters_to_paper"], row["seconds_to_paper"] = time_to_paper(
                    run_dir, attack, metrics, row["paper_ssim"]
                )
                if exp.accuracy is not None:
                    row["paper_accuracy"] = cell.paper.get("accuracy")
                    row["accuracy_final"] = acc["final"] if acc else None
                    row["accuracy_best"] = acc["best"] if acc else None
                    row["fl_rounds"] = acc["rounds"] if acc else None
                rows.append(row)
    return rows


def _figure(exp: Experiment, fig: dict[str, Any], rows: list[dict[str, Any]], path: Path) -> bool:

    metric = fig["metric"]
    paper_key = {"ssim_paper": "paper_ssim", "mmd": "paper_mmd"}.get(metric)
    rows = [r for r in rows if r["experiment"] == exp.name and (fig.get("attack") in (None, r["attack"]))]
    if metric == "mmd":
        rows = [r for r in rows if r["attack"] in ("dia", "dia_april")]
    # a panel is drawn only where there is something to show: ours measured, or the paper's value
    rows = [r for r in rows if r.get(f"{metric}_mean") is not None or (paper_key and r.get(paper_key) is not None)]
    panel_keys = list(fig.get("panel") or [])
    panels = sorted({tuple(r[k] for k in panel_keys) for r in rows})
    if not rows or not panels:
        return False
    fig_ = Figure(figsize=(4.2 * len(panels), 3.4))
    axes = fig_.subplots(1, len(panels), squeeze=False)
    x_key, s_key = fig["x"], fig["series"]
    for ax, panel in zip(axes[0], panels):
        prow = [r for r in rows if tuple(r[k] for k in panel_keys) == panel]
        for i, series in enumerate(
            sorted(
                {r[s_key] for r in prow}, key=lambda v: (v is None, str(v) if not isinstance(v, (int, float)) else v)
            )
        ):
            srow = sorted((r for r in prow if r[s_key] == series), key=lambda r: r[x_key])
            color = f"C{i}"
            ours = [
                (r[x_key], r[f"{metric}_mean"], r[f"{metric}_std"]) for r in srow if r.get(f"{metric}_mean") is not None
            ]
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
    atomic_write(path, figure_png(fig_, trim=False))
    return True


def write_report(
    experiments: list[Experiment], selected: list[tuple[Experiment, Cell]], out: str | Path, settings: Settings
) -> Path:
    out = Path(out)
    rows = collect_rows(experiments, selected, out, settings)
    atomic_write(out / "results.csv", csv_text(rows))
    iters = f"{settings.iterations:,}" if settings.iterations else "the configs' (paper: 20,000)"
    lines = [
        '# Reproduction of "Dropout is NOT All You Need to Prevent Gradient Leakage"\n',
        f"Victims: {settings.victim_source} ({settings.victims or 'the configs’'} images per cell); iteration cap: "
        f"{iters}; device: {settings.device}; attack profile: {settings.profile}. "
        f"Updated {time.strftime('%Y-%m-%d %H:%M:%S')}.\n",
        "**SSIM spaces.** *SSIM (paper space)* is computed on normalized tensors with data_range = 1/std — the space "
        "the paper's numbers live in, so compare it with the *paper* column. *SSIM [0,1]* is the standard space "
        "(images mapped back to [0,1], data_range 1); it runs lower. *SSIM min-max* scales each image on its own "
        "to [0,1] by its minimum and maximum (the authors' later code's ScaledSSIM); it forgives brightness and "
        "contrast offsets, not noise in a flat background. For B > 1 reconstructions are matched to "
        "originals (Hungarian assignment); `results.csv` also holds the unmatched SSIM. Values are mean ± std over "
        "victim jobs (the *victims* column: jobs × B; a job's value is the mean over its B images); "
        "the paper used 128 victims (Table 4: 10) and up to 20,000 iterations.\n",
    ]
    for exp in experiments:
        erows = [r for r in rows if r["experiment"] == exp.name]
        lines.append(f"\n## {exp.title}\n")
        if exp.source:
            lines.append(f"Paper values: {exp.source}.\n")
        lines += _table(exp, erows)
        defended = any(r.get("defense") for r in erows)
        has_acc = exp.accuracy is not None
        if defended:
            lines.append(
                f"\nAccuracy: the defended federation's global test accuracy after its {settings.fl_rounds} "
                "training rounds; the attacks run on one further, audited round under the same defense. "
                "ε: Flower's RdpAccountant over all rounds (no sampling amplification; local DP: each "
                "client's own guarantee). RDLV = (SSIM(recon) − SSIM(prior)) / SSIM(prior), the prior being "
                "the mean image of the run's other victims.\n"
            )
            path = out / "figures" / f"{exp.name}_frontier.png"
            if frontier_figure(erows, path):
                lines.append(f"\n![{exp.name} frontier](figures/{path.name})\n")
        elif has_acc:
            paper_rounds = exp.accuracy.get("paper_rounds") if exp.accuracy else None
            lines.append(
                f"\nAccuracy: global test accuracy after {settings.fl_rounds} federated rounds "
                f"({'run' if settings.accuracy else 'skipped: --no-accuracy'}; the paper trains to convergence, "
                f"up to {paper_rounds} rounds), from `accuracy/`.\n"
            )
        for fig in exp.figures:
            path = out / "figures" / f"{exp.name}_{fig['name']}.png"
            if _figure(exp, fig, rows, path):
                lines.append(f"\n![{exp.name} {fig['name']}](figures/{path.name})\n")
        shown = [c for c in exp.cells if run_state(cell_dir(out, c)) == "finished"]
        if shown:
            lines.append("\n<details><summary>Reconstructions and loss curves per cell</summary>\n")
            for c in shown:
                lines.append(
                    f"\n**{c.key}** ({c.label(settings.iterations)}) — [report](cells/{c.key}/report.md)\n\n"
                    f"![grid](cells/{c.key}/grid.png) ![loss](cells/{c.key}/loss_curves.png)\n"
                )
            lines.append("\n</details>\n")
    path = out / "results.md"
    atomic_write(path, "\n".join(lines) + "\n")
    return path


def _table(exp: Experiment, erows: list[dict[str, Any]]) -> list[str]:
    """An experiment's results table: the columns its rows have (λ_mask, local round, defense, curves,
    MMD, accuracy) and one line per cell and attack."""
    table: list[str] = []
    has_mmd = "mmd" in exp.metrics
    has_acc = exp.accuracy is not None
    head = ["cell", "model", "data", "p", "B"]
    if any(r["lambda_mask"] is not None for r in erows):
        head.append("λ_mask")
    if any(r["mask_init"] is not None for r in erows):
        head.append("mask init")
    if any(r.get("K") is not None for r in erows):
        head += ["local round", "K"]
    defended = any(r.get("defense") for r in erows)
    if defended:
        head += ["defense", "level", "ε (δ), all rounds"]
    head += ["attack", "victims", "SSIM paper-space (ours)", "SSIM paper", "SSIM [0,1] (ours)", "SSIM min-max (ours)"]
    if defended:
        head.append("RDLV (ours)")
    curves = any(r.get("reached_ssim90") is not None for r in erows)
    if curves:
        head.append("iterations to SSIM 0.9 (reached)")
    to_paper = any(r.get("paper_ssim") is not None and r["status"] == "finished" for r in erows)
    if to_paper:
        head.append("time to the paper's SSIM (its / s)")
    if has_mmd:
        head += ["MMD (ours)", "MMD paper"]
    if has_acc:
        head += ["acc % final/best (ours)", "acc % paper"]
    head.append("status")
    table.append("| " + " | ".join(head) + " |")
    table.append("|" + "---|" * len(head))
    for r in erows:
        cells = [r["cell"], r["model"], r["dataset"], f"{r['p']:g}", str(r["B"])]
        if "λ_mask" in head:
            cells.append("–" if r["lambda_mask"] is None else f"{r['lambda_mask']:g}")
        if "mask init" in head:
            cells.append(r["mask_init"] or "–")
        if "K" in head:
            cells += [r.get("local_round") or "one step", str(r.get("K") or 1)]
        if defended:
            cells += [r.get("defense") or "–", level_text(r), epsilon_text(r)]
        victims = "–" if not r["victims"] else (f"{r['victims']}×{r['B']}" if r["B"] > 1 else str(r["victims"]))
        cells += [
            r["attack"],
            victims,
            fmt_mean_std(r["ssim_paper_mean"], r["ssim_paper_std"]),
            fmt_mean_std(r["paper_ssim"], digits=2),
            fmt_mean_std(r["ssim_std_mean"], r["ssim_std_std"]),
            fmt_mean_std(r.get("ssim_minmax_mean"), r.get("ssim_minmax_std")),
        ]
        if defended:
            cells.append(fmt_mean_std(r.get("rdlv_mean"), r.get("rdlv_std"), digits=2))
        if curves:
            reached = r.get("reached_ssim90")
            mean = r.get("iters_to_ssim90_mean")
            cells.append(
                "–"
                if reached is None
                else f"{mean:.0f} ({reached}/{r['victims'] or '?'})"
                if mean is not None
                else f"never (0/{r['victims'] or '?'})"
            )
        if to_paper:
            its, secs = r.get("iters_to_paper"), r.get("seconds_to_paper")
            cells.append(
                "–"
                if r.get("paper_ssim") is None or r["status"] != "finished"
                else "not reached"
                if its is None
                else f"{its:,} / {secs:.0f} s"
                if secs is not None
                else f"{its:,}"
            )
        if has_mmd:
            cells += [fmt_mean_std(r["mmd_mean"], r["mmd_std"]), fmt_mean_std(r["paper_mmd"], digits=2)]
        if has_acc:
            acc = (
                "–"
                if r.get("accuracy_final") is None
                else f"{r['accuracy_final']:.2f} / {r['accuracy_best']:.2f} ({r['fl_rounds']} rounds)"
            )
            cells += [acc, fmt_mean_std(r.get("paper_accuracy"), digits=2)]
        cells.append(r["status"])
        table.append("| " + " | ".join(cells) + " |")
    return table
