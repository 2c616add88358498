"""Write a run's results: per-job metrics (CSV, JSON), a summary table, loss curves, the image
grid, learned masks, and a short markdown report. Every file is written atomically."""

from __future__ import annotations

import csv
import io
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as save_safetensors

from fedsim.atomic import atomic_write  # noqa: F401 - pipeline, story and the experiments write through it
from fedsim.data import denormalize, get_spec

from .jobs import JobResult, Oracle, VictimJob

SUMMARY_KEYS = (
    "ssim_paper",
    "ssim_std",
    "ssim_minmax",
    "psnr_paper",
    "mse_paper",
    "lpips",
    "rdlv",
    "mmd",
    "trd",
    "iterations",
    "iters_to_ssim90",
)


def _captured(defense: str) -> str:
    from fedsim.defenses import DEFENSES

    return DEFENSES[defense].captured if defense in DEFENSES else "what the capture file holds"


def figure_png(fig, *, trim: bool = True) -> bytes:
    """A matplotlib figure as PNG bytes (110 dpi); ``trim`` crops the empty margin.

    Figures are built as ``matplotlib.figure.Figure`` objects, not through pyplot: no backend is chosen
    or switched (a notebook keeps its own), no display is needed, and nothing global holds them."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight" if trim else None)
    return buf.getvalue()


def fmt_mean_std(mean: float | None, std: float | None = None, digits: int = 3) -> str:
    """``mean ± std`` (just ``mean`` without a std), or "–" for a missing or NaN mean."""
    if mean is None or (isinstance(mean, float) and math.isnan(mean)):
        return "–"
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if std is not None else f"{mean:.{digits}f}"


def csv_text(rows: list[dict[str, Any]]) -> str:
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=keys)
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def summarize_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean and std per attack (and model, dataset, p, B) over victims."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        groups[(row["attack"], row["model"], row["dataset"], row["p"], row["batch_size"])].append(row)
    summary = []
    for (attack, model, dataset, p, b), members in groups.items():
        entry: dict[str, Any] = {
            "attack": attack,
            "model": model,
            "dataset": dataset,
            "p": p,
            "batch_size": b,
            "victims": len(members),
        }
        for key in SUMMARY_KEYS:
            vals = [float(m[key]) for m in members if m.get(key) is not None and math.isfinite(float(m[key]))]
            if vals:
                t = torch.tensor(vals, dtype=torch.float64)
                entry[f"{key}_mean"] = t.mean().item()
                entry[f"{key}_std"] = t.std(unbiased=False).item()
        # how many jobs reached SSIM 0.9 within the run (iters_to_ssim90 is their mean), of those scored
        entry["reached_ssim90"] = sum(m.get("iters_to_ssim90") is not None for m in members)
        entry["optimized_values"] = members[0]["optimized_values"]
        entry["statuses"] = ",".join(sorted({m["status"] for m in members}))
        entry["profile"] = members[0].get("profile", "")
        summary.append(entry)
    return summary


def format_table(summary: list[dict[str, Any]]) -> str:
    """Markdown table of the summary (SSIM in its three spaces, labelled)."""
    head = (
        "| attack | model | data | p | B | victims | SSIM (paper space) | SSIM ([0,1]) | SSIM (min-max) "
        "| PSNR (paper) | LPIPS "
        "| MMD | TRD | optimized values |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def cell(entry: dict, key: str, digits: int = 3) -> str:
        return fmt_mean_std(entry.get(f"{key}_mean"), entry.get(f"{key}_std"), digits)

    for e in summary:
        lines.append(
            f"| {e['attack']} | {e['model']} | {e['dataset']} | {e['p']} | {e['batch_size']} | {e['victims']} | "
            f"{cell(e, 'ssim_paper')} | {cell(e, 'ssim_std')} | {cell(e, 'ssim_minmax')} | "
            f"{cell(e, 'psnr_paper', 2)} | {cell(e, 'lpips')} | "
            f"{cell(e, 'mmd')} | {cell(e, 'trd')} | {e['optimized_values']:,} |"
        )
    return "\n".join(lines) + "\n"


def closed_form_lines(rows: list[dict[str, Any]], skipped: dict[str, str]) -> str:
    """The closed forms' part of the report: per solver how many jobs it solved exactly (full rank,
    relative residual <= 1e-6), the worst residual and the ranks; and why a solver did not run."""
    solved: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if "relative_residual" in row:
            solved[row["attack"]].append(row)
    if not solved and not skipped:
        return ""
    lines = ["", "Closed forms (one shot, 0 iterations; exact: full rank and relative residual ≤ 1e-6):", ""]
    for name, members in solved.items():
        exact = sum(bool(m["exact"]) for m in members)
        ranks = sorted({f"{m['rank']}/{m['unknowns']}" for m in members})
        worst = max(float(m["relative_residual"]) for m in members)
        seconds = sum(float(m.get("solve_seconds", 0.0)) for m in members) / len(members)
        lines.append(
            f"- {name}: {exact} of {len(members)} jobs exact; rank {', '.join(ranks)}; largest relative residual "
            f"{worst:.1e}; {seconds:.3f} s per job."
        )
    lines += [f"- skipped: {reason}." for reason in skipped.values()]
    return "\n".join(lines) + "\n"


def image_grid(
    jobs: list[VictimJob], oracles: list[Oracle | None], results: list[JobResult], max_victims: int = 8
) -> bytes:
    """Originals in the first row, then one row per attack, one column per victim image."""
    victims: list[str] = []
    originals: dict[str, torch.Tensor] = {}
    recons: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for job, oracle, res in zip(jobs, oracles, results):
        if job.job_id not in originals and oracle is not None:
            victims.append(job.job_id)
            originals[job.job_id] = oracle.images
        recons[res.attack][job.job_id] = res.images
    victims = victims[:max_victims]
    if not victims:
        victims = sorted({j.job_id for j in jobs})[:max_victims]
    spec = get_spec(jobs[0].spec.dataset, jobs[0].spec.input_shape[0])
    rows = (["original"] if originals else []) + list(recons)
    per_victim = jobs[0].batch_size
    cols = len(victims) * per_victim
    from matplotlib.figure import Figure  # here: matplotlib (about 0.7 s) only in runs that draw

    fig = Figure(figsize=(1.3 * cols, 1.4 * len(rows)))
    axes = fig.subplots(len(rows), cols, squeeze=False)
    for r, row in enumerate(rows):
        for v, victim in enumerate(victims):
            batch = originals.get(victim) if row == "original" else recons[row].get(victim)
            for b in range(per_victim):
                ax = axes[r][v * per_victim + b]
                ax.set_xticks([])
                ax.set_yticks([])
                if batch is None:
                    continue
                img = denormalize(batch[b : b + 1].float(), spec, clamp=True)[0].permute(1, 2, 0).numpy()
                ax.imshow(img.squeeze(-1) if img.shape[-1] == 1 else img, cmap="gray" if img.shape[-1] == 1 else None)
            if v == 0:
                axes[r][0].set_ylabel(row, fontsize=9)
    return figure_png(fig)


def loss_plot(results: list[JobResult]) -> bytes:
    from matplotlib.figure import Figure  # as in the grid above

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    colors: dict[str, Any] = {}
    for res in results:
        if not res.losses:
            continue
        color = colors.setdefault(res.attack, f"C{len(colors)}")
        ax.plot(
            res.losses,
            color=color,
            alpha=0.5,
            lw=0.8,
            label=res.attack if res.attack not in ax.get_legend_handles_labels()[1] else None,
        )
    ax.set_yscale("log")
    ax.set_xlabel("iteration")
    ax.set_ylabel("reconstruction loss")
    ax.legend()
    ax.grid(alpha=0.3)
    return figure_png(fig)


def write_results(
    run_dir: Path,
    jobs: list[VictimJob],
    oracles: list[Oracle | None],
    results: list[JobResult],
    rows: list[dict[str, Any]],
    title: str = "Gradient inversion run",
    skipped: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    run_dir = Path(run_dir)
    summary = summarize_rows(rows)
    atomic_write(run_dir / "metrics.csv", csv_text(rows))
    atomic_write(run_dir / "metrics.json", json.dumps(rows, indent=2, default=float))
    atomic_write(run_dir / "summary.csv", csv_text(summary))
    atomic_write(run_dir / "summary.json", json.dumps(summary, indent=2))
    curves = [
        {"job": r.job_id, "attack": r.attack, "iteration": i, "loss": v}
        for r in results
        for i, v in enumerate(r.losses)
    ]
    atomic_write(run_dir / "loss_curves.csv", csv_text(curves) if curves else "job,attack,iteration,loss\n")
    atomic_write(run_dir / "loss_curves.png", loss_plot(results))
    points = [
        {"job": r.job_id, "attack": r.attack, "iteration": it, "ssim_paper": s}
        for r in results
        for it, s in r.ssim_curve
    ]
    atomic_write(run_dir / "ssim_curves.csv", csv_text(points) if points else "job,attack,iteration,ssim_paper\n")
    atomic_write(run_dir / "grid.png", image_grid(jobs, oracles, results))
    tensors = {}
    for res in results:
        tensors[f"{res.job_id}/{res.attack}/images"] = res.images.contiguous()
        for i, m in enumerate(res.masks or []):
            tensors[f"{res.job_id}/{res.attack}/mask{i:02d}"] = m.contiguous()
    atomic_write(run_dir / "reconstructions.safetensors", save_safetensors(tensors))
    labels = sorted({r["labels"] for r in rows})
    defended = sorted({(r.get("defense", "none"), r.get("adaptation", "none")) for r in rows} - {("none", "none")})
    defense_lines = "".join(
        f"Defense {name}: the server captured {_captured(name)}; the attack's adaptation: {adaptation}.\n\n"
        for name, adaptation in defended
    )
    report = (
        f"# {title}\n\n"
        f"Labels: {', '.join(labels)}. SSIM/PSNR in *paper space* are computed on normalized tensors with "
        f"data_range = 1/std (the space of the paper's tables); *[0,1]* is the standard space.\n\n"
        + defense_lines
        + format_table(summary)
        + closed_form_lines(rows, skipped or {})
        + "\n![reconstructions](grid.png)\n\n![loss curves](loss_curves.png)\n"
    )
    atomic_write(run_dir / "report.md", report)
    return summary
