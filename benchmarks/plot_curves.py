"""SSIM against the iteration beside the loss, for several attack runs of the same cell.

    python benchmarks/plot_curves.py --out FIG.png LABEL=RUN_DIR [LABEL=RUN_DIR ...]

Each run folder's ``ssim_curves.csv`` (paper-space SSIM of the current iterate, every 100 iterations)
and ``loss_curves.csv`` give one line per run: the mean over its jobs. Used for docs/results/profiles.md's figure
of the options tried on the ResNet, where the SSIM falls while the loss keeps falling.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import defaultdict
from pathlib import Path

from matplotlib.figure import Figure


def mean_by_iteration(path: Path, column: str) -> tuple[list[int], list[float]]:
    values: dict[int, list[float]] = defaultdict(list)
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            values[int(row["iteration"])].append(float(row[column]))
    its = sorted(values)
    return its, [sum(values[i]) / len(values[i]) for i in its]


def smooth(ys: list[float], window: int = 50) -> list[float]:
    """A trailing running mean: a per-iteration loss is noisy (IG (train) draws masks each step)."""
    out, total = [], 0.0
    for i, y in enumerate(ys):
        total += y - (ys[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="LABEL=RUN_DIR")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    runs = []
    for item in args.runs:
        label, sep, folder = item.partition("=")
        run = Path(folder)
        if not sep or not (run / "ssim_curves.csv").is_file() or not (run / "loss_curves.csv").is_file():
            print(f"error: {item!r} is not LABEL=RUN_DIR with ssim_curves.csv and loss_curves.csv", file=sys.stderr)
            return 2
        runs.append((label, run))
    if args.out.exists():
        print(f"error: {args.out} exists; choose another --out", file=sys.stderr)
        return 2
    fig = Figure(figsize=(10, 3.8))
    ssim_ax, loss_ax = fig.subplots(1, 2)
    for label, run in runs:
        its, ssim = mean_by_iteration(run / "ssim_curves.csv", "ssim_paper")
        ssim_ax.plot(its, ssim, marker=".", label=label)
        its, loss = mean_by_iteration(run / "loss_curves.csv", "loss")
        loss_ax.plot(its, smooth(loss), label=label)
    ssim_ax.set(xlabel="iteration", ylabel="SSIM of the iterate (paper space)", title="SSIM")
    loss_ax.set(xlabel="iteration", ylabel="loss (running mean of 50)", yscale="log", title="loss")
    for ax in (ssim_ax, loss_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if args.title:
        fig.suptitle(args.title, fontsize=10)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
