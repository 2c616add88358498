"""Redraw the defenses frontier figures (docs/results/defenses.md) with the DP-SGD family beside them.

The local-DP, central-DP and pruning rows come from docs/results/defenses.md's tables (their run folders,
runs/defenses-mlp and runs/defenses-lenet-4k, took 40 and 89 minutes and need not be kept), the DP-SGD
family's from the dp_sgd experiment's results.csv; the figure is attacker.experiments.frontier's
(one panel per p, each family joined from its own undefended cell, weakest level to strongest).

usage: python benchmarks/frontier_figures.py DEFENSES_MD DPSGD_OUT_DIR MODEL OUT.png
  e.g. python benchmarks/frontier_figures.py docs/results/defenses.md runs/dpsgd-mlp mlp \
           docs/results/defenses_frontier_mlp.png
"""

import csv
import math
import re
import sys
from pathlib import Path

from attacker.experiments.frontier import frontier_figure

LEVEL = {"ε/round": "local-dp", "z": "central-dp-server-clipping", "keep": "prune"}


def results_md_rows(text: str, model: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 9 or cells[0] != model:
            continue
        _, p, defense, level, _eps, acc, ig, dia, _rdlv = cells
        knob = None if level == "–" else float(level.split()[-1])
        for attack, value in (("ig_eval", ig), ("dia", dia)):
            rows.append(
                {
                    "experiment": "defenses",
                    "defense": defense,
                    "defense_level": knob,
                    "attack": attack,
                    "model": model,
                    "dataset": "mnist",
                    "p": float(p),
                    "accuracy_final": float(acc),
                    "ssim_paper_mean": float(re.split(r"\s*±", value)[0]),
                }
            )
    return rows


def dpsgd_rows(out: Path, model: str) -> list[dict]:
    rows = []
    with open(out / "results.csv") as f:
        for r in csv.DictReader(f):
            if r["model"] != model or r.get("status") != "finished" or not r.get("ssim_paper_mean"):
                continue
            level = r.get("defense_level") or ""
            rows.append(
                {
                    "experiment": "dp_sgd",
                    "defense": r["defense"],
                    "defense_level": (math.inf if level in ("inf", "Infinity") else float(level)) if level else None,
                    "attack": r["attack"],
                    "model": model,
                    "dataset": r["dataset"],
                    "p": float(r["p"]),
                    "accuracy_final": float(r["accuracy_final"]) if r.get("accuracy_final") else None,
                    "ssim_paper_mean": float(r["ssim_paper_mean"]),
                }
            )
    return rows


if __name__ == "__main__":
    results_md, out, model, png = sys.argv[1:5]  # results_md: docs/results/defenses.md
    rows = results_md_rows(Path(results_md).read_text(), model)
    if Path(out, "results.csv").is_file():
        rows += dpsgd_rows(Path(out), model)
    print(len(rows), "rows;", frontier_figure(rows, Path(png)))
